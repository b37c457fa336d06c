"""The user's loop (``jabasray.train``) driving one device's engine, without Ray, in float64.

Proves: the engine fed by a loop (its batches are the engine's ``step_fn`` calls, its
``loss.backward()`` hands the loss back) updates exactly as the engine fed by a ``step_fn`` -
two VSWs with per-VSW BatchNorm, two accumulation rounds, an LR factor - with
``optimizer.step()`` True only after an iteration's last round and the epoch's end reaching the
loop's ``epochs()``; at a fixed batch every update (a ragged last iteration, run per VSW on
threads, included) equals one plain SGD step on the union of the micro-batches; and the loop's
misuses are one-line ValueErrors naming what to change.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jabasray.engine.iidp import IIDPWorker
from jabasray.train import bridge, epochs, prepare_data_loader, prepare_model, prepare_optimizer
from jabasray.train.actor import LoopCallables

pytestmark = pytest.mark.usefixtures("float64")


def data(n=64):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def bn_net():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def make_loop(ds, build, steps, **kw):
    """A Ray Train-shaped loop over ``ds``; ``steps`` collects what ``optimizer.step()`` said."""
    def loop(config):
        loader = prepare_data_loader(torch.utils.data.DataLoader(ds, batch_size=8))
        model = prepare_model(build())
        if kw.get("move"):
            model.to("cpu")
        opt = prepare_optimizer(sgd(model.parameters()))
        for _ in epochs(config["epochs"], model=model, optimizer=opt):
            for x, y in loader:
                out = model(x)
                loss = F.cross_entropy(out, y, reduction="none" if kw.get("unreduced") else "mean")
                opt.zero_grad()
                loss.backward()
                steps.append(opt.step())
                if kw.get("skip"):
                    next(iter(loader))
    return loop


def loop_worker(loop, epochs_=1, seed=1, **cfg):
    calls = LoopCallables(loop, {"epochs": epochs_, **cfg}, epochs_)
    calls.dataset_fn()
    torch.manual_seed(seed)
    return IIDPWorker(calls.model_fn(), calls.optimizer_fn, None, step_fn=calls.step_fn), bridge.active()


def micro(ds, idx, sizes):
    X, y = ds.tensors
    out, k = [], 0
    for s in sizes:
        out.append((X[idx[k:k + s]], y[idx[k:k + s]]))
        k += s
    return out


def test_loop_updates_as_the_step_fn_engine_with_vsws_bn_and_accumulation():
    ds, steps = data(), []
    w, run = loop_worker(make_loop(ds, bn_net, steps))
    torch.manual_seed(1)
    ref = IIDPWorker(bn_net(), sgd, F.cross_entropy)
    for worker in (w, ref):
        worker.configure(2, 1, 4)           # 2 VSWs x 2 accumulation rounds of B_L = 4
        worker.lr_factor = 1.5
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(2))
    for it in range(3):
        mbs = micro(ds, perm[it * 16:(it + 1) * 16], [4] * 4)
        sa, sb = w.train_step(mbs), ref.train_step(mbs)
        run.after_step(epoch_end=it == 2)
        torch.testing.assert_close(sa.loss, sb.loss)
    assert steps == [False, True] * 3       # one update per iteration, after its last round
    assert run.pending[0] == "epoch_end"    # the loader ended, the loop is back in epochs()
    for a, b in zip(w.state_dict()["model"].values(), ref.state_dict()["model"].values()):
        torch.testing.assert_close(a, b)
    for a, b in zip(w.optimizer.state.values(), ref.optimizer.state.values()):
        torch.testing.assert_close(a["momentum_buffer"], b["momentum_buffer"])
    run.finish()
    assert run.finished


def test_loop_at_a_fixed_batch_equals_plain_sgd_on_the_union():
    ds, steps = data(), []
    w, run = loop_worker(make_loop(ds, mlp, steps))
    w.configure(2, 1, 4)
    torch.manual_seed(1)
    model = mlp()
    opt = sgd(model.parameters())
    X, y = ds.tensors
    perm = torch.randperm(60, generator=torch.Generator().manual_seed(3))
    sizes = [[4] * 4, [4] * 4, [4] * 4, [4, 4, 3, 1]]        # the last iteration ragged
    k = 0
    for it, sz in enumerate(sizes):
        idx = perm[k:k + sum(sz)]
        k += sum(sz)
        w.train_step(micro(ds, idx, sz), ragged=it == 3)
        run.after_step(epoch_end=it == 3)
        opt.zero_grad()
        F.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()
        for a, b in zip(w.model.parameters(), model.parameters()):
            torch.testing.assert_close(a, b)
    assert steps.count(True) == 4
    run.finish()


@pytest.mark.parametrize("kw, words", [
    ({"move": True}, "moved or cast (.to(), .cuda(), .double()) after prepare_model"),
    ({"skip": True}, "did not call backward() on the loss of a batch"),
    ({"unreduced": True}, "the loss must be a scalar (a per-sample mean)"),
    ({"epochs_": 2}, "asks for epochs(2) but JobConfig.epochs is 1"),
])
def test_loop_misuse_is_a_one_line_value_error(kw, words):
    ds = data()
    n = kw.pop("epochs_", 1)
    calls = LoopCallables(make_loop(ds, mlp, [], **kw), {"epochs": n}, 1)
    with pytest.raises(ValueError) as e:
        calls.dataset_fn()
        w = IIDPWorker(calls.model_fn(), calls.optimizer_fn, None, step_fn=calls.step_fn)
        w.configure(1, 0, 8)
        for it in range(2):
            w.train_step(micro(ds, torch.arange(it * 8, it * 8 + 8), [8]))
            bridge.active().after_step(False)
    assert words in str(e.value) and "\n" not in str(e.value)
    bridge.active().abandon()


def test_prepare_outside_a_loop_is_refused():
    with pytest.raises(ValueError, match="must be called inside train_loop_per_worker"):
        prepare_model(mlp())


def two_optimizers(model):
    body = [p for n, p in model.named_parameters() if n.removeprefix("module.").startswith("0.")]
    head = [p for n, p in model.named_parameters() if not n.removeprefix("module.").startswith("0.")]
    return (torch.optim.SGD(body, lr=0.1, momentum=0.9),
            torch.optim.Adam(head, lr=0.01, betas=(0.8, 0.9)))


def scaler_loop(ds, steps, enabled=False):
    """Two optimizers (a body and a head) and a GradScaler, as an AMP loop writes them."""
    def loop(config):
        loader = prepare_data_loader(ds)
        model = prepare_model(mlp())
        opt_a, opt_b = prepare_optimizer(*two_optimizers(model))
        scaler = torch.amp.GradScaler("cpu", enabled=enabled)
        for _ in epochs(1, model=model, opt_a=opt_a, opt_b=opt_b, scaler=scaler):
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                opt_a.zero_grad()
                opt_b.zero_grad()
                scaler.scale(loss).backward()
                steps.append((scaler.step(opt_a), scaler.step(opt_b)))
                scaler.update()
    return loop


@pytest.mark.parametrize("weight_sync", ["sws", "ows"])
def test_two_optimizers_and_a_grad_scaler_equal_the_plain_computation(weight_sync):
    """SGD on the body, Adam on the head, a (disabled) GradScaler; the engine steps both as
    one (whole, or bucket by bucket under one-way weight sync): weights and both optimizers'
    states equal two plain optimizers stepping on the union of the micro-batches."""
    ds, steps = data(), []
    calls = LoopCallables(scaler_loop(ds, steps), None, 1)
    calls.dataset_fn()
    torch.manual_seed(1)
    w = IIDPWorker(calls.model_fn(), calls.optimizer_fn, None, step_fn=calls.step_fn,
                   weight_sync=weight_sync, bucket_cap_mb=1e-4)      # one bucket per tensor
    run = bridge.active()
    w.configure(2, 1, 4)
    torch.manual_seed(1)
    model = mlp()
    opts = two_optimizers(model)
    X, y = ds.tensors
    for it in range(3):
        idx = torch.arange(it * 16, it * 16 + 16)
        w.train_step(micro(ds, idx, [4] * 4))
        run.after_step(epoch_end=it == 2)
        for o in opts:
            o.zero_grad()
        F.cross_entropy(model(X[idx]), y[idx]).backward()
        for o in opts:
            o.step()
    assert w.weight_sync_method == weight_sync
    assert steps == [(False, False), (True, True)] * 3
    for a, b in zip(w.model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b)
    for sub, ref in zip(w.optimizer.optimizers, opts):       # state per parameter
        pa = [p for g in sub.param_groups for p in g["params"]]
        pb = [p for g in ref.param_groups for p in g["params"]]
        for a, b in zip(pa, pb):
            assert set(sub.state[a]) == set(ref.state[b]) != set()
            for k, v in ref.state[b].items():
                torch.testing.assert_close(torch.as_tensor(sub.state[a][k]), torch.as_tensor(v))
    assert set(run.extra_state()) == {"scaler"}          # the optimizers are the engine's
    run.finish()


def test_an_enabled_grad_scaler_is_refused():
    ds = data()
    calls = LoopCallables(scaler_loop(ds, [], enabled=True), None, 1)
    calls.dataset_fn()
    w = IIDPWorker(calls.model_fn(), calls.optimizer_fn, None, step_fn=calls.step_fn)
    w.configure(1, 0, 8)
    with pytest.raises(ValueError, match=r"scaler= is an enabled GradScaler.*precision='fp16'"):
        w.train_step(micro(ds, torch.arange(8), [8]))
    bridge.active().abandon()


def test_cli_script_and_example_define_a_loop_and_the_trainer_refuses_other_modes(tmp_path):
    """``jabasray train --script`` takes a file that defines ``train_loop_per_worker`` (the
    example's port of Ray Train's quick start); a loop job refuses SMA and burst modes and a
    mismatch of train_loop_config and the loop's signature, in one line, before any work."""
    from pathlib import Path

    from jabasray.commands.train import load_script
    from jabasray.config import JobConfig, RunConfig
    from jabasray.train import JabasTorchTrainer

    example = Path(__file__).resolve().parents[1] / "examples" / "fashion_mnist_loop.py"
    ns = load_script(str(example))
    assert callable(ns["train_loop_per_worker"]) and ns["train_loop_config"]["epochs"] == 3
    rc = RunConfig(str(tmp_path), "x")
    t = JabasTorchTrainer(ns["train_loop_per_worker"], train_loop_config=ns["train_loop_config"],
                          job_config=JobConfig(epochs=3), run_config=rc)
    assert t.trainer.hooks.actor_class.__name__ == "LoopGPUActor" and t.trainer.job.cuda_graphs == "off"
    for job, words in ((JobConfig(sync="sma"), "sync='iidp'"), (JobConfig(parallelism="burst"), "parallelism='data'")):
        with pytest.raises(ValueError, match=words):
            JabasTorchTrainer(ns["train_loop_per_worker"], job_config=job, run_config=rc)
    with pytest.raises(ValueError, match="takes no argument"):
        JabasTorchTrainer(lambda: None, train_loop_config={"a": 1}, run_config=rc)


def test_a_copy_of_the_loops_model_trains_with_a_clone_of_its_optimizers():
    """The profiler measures a deep copy of ``model_fn()``'s model: the loop's optimizers are
    cloned over the copy's parameters (settings kept, state fresh) and its steps run the loop's
    code on the copy; the loop's own model and optimizers are untouched."""
    import copy

    ds = data()
    calls = LoopCallables(scaler_loop(ds, []), None, 1)
    calls.dataset_fn()
    torch.manual_seed(1)
    base = calls.model_fn()
    before = copy.deepcopy(base.state_dict())
    w = IIDPWorker(copy.deepcopy(base), calls.optimizer_fn, None, step_fn=calls.step_fn)
    run = bridge.active()
    assert w.optimizer is not run.optimizer
    assert [type(o) for o in w.optimizer.optimizers] == [torch.optim.SGD, torch.optim.Adam]
    assert [g["lr"] for g in w.optimizer.param_groups] == [0.1, 0.01]
    w.configure(1, 0, 8)
    w.train_step(micro(ds, torch.arange(8), [8]))
    assert any(not torch.equal(a, b) for a, b in zip(w.model.state_dict().values(), before.values()))
    for k, v in base.state_dict().items():
        assert torch.equal(v, before[k])
    run.abandon()


def test_the_loops_forward_runs_under_the_engines_autocast():
    """precision="bf16": autocast is per thread, so the loop's forward enters the engine's
    (the same bf16 losses and updates as the step_fn engine; an fp32 forward would differ
    by ~1e-2)."""
    ds32 = torch.utils.data.TensorDataset(data().tensors[0].float(), data().tensors[1])
    torch.manual_seed(1)
    ref_model = mlp().float()
    calls = LoopCallables(make_loop(ds32, lambda: mlp().float(), []), {"epochs": 1}, 1)
    calls.dataset_fn()
    base = calls.model_fn()
    base.load_state_dict(ref_model.state_dict())
    loop_w = IIDPWorker(base, calls.optimizer_fn, None, step_fn=calls.step_fn, precision="bf16")
    run = bridge.active()
    ref = IIDPWorker(ref_model, sgd, F.cross_entropy, precision="bf16")
    for worker in (loop_w, ref):
        worker.configure(2, 0, 8)
    for it in range(2):
        mbs = micro(ds32, torch.arange(it * 16, it * 16 + 16), [8, 8])
        la, lb = loop_w.train_step(mbs).loss, ref.train_step(mbs).loss
        run.after_step(False)
        torch.testing.assert_close(la, lb, rtol=0, atol=0)
    for a, b in zip(loop_w.model.parameters(), ref.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    run.abandon()


def test_an_eval_loader_serves_this_ranks_shard_in_order_under_no_grad():
    """prepare_data_loader(eval=True): at the epoch end the loop evaluates on rank 1 of 3 the
    contiguous shard [N/3, 2N/3) of the validation set, every sample once, in order; the
    engine's training data is untouched."""
    from jabasray.train.api import LoopContext

    ds, val = data(), data(25)
    seen = []

    def loop(config):
        loader = prepare_data_loader(ds)
        val_loader = prepare_data_loader(torch.utils.data.DataLoader(val, batch_size=4), eval=True)
        model = prepare_model(mlp())
        opt = prepare_optimizer(sgd(model.parameters()))
        for _ in epochs(1, model=model, optimizer=opt):
            for x, y in loader:
                F.cross_entropy(model(x), y).backward()
                opt.step()
            with torch.no_grad():
                for x, y in val_loader:
                    assert model(x).shape == (len(y), 3)
                    seen.extend(y.tolist())

    w, run = loop_worker(loop)
    w.configure(1, 0, 8)
    run.context = LoopContext(world_rank=1, world_size=3)
    w.train_step(micro(ds, torch.arange(8), [8]))
    run.after_step(epoch_end=True)
    assert seen == val.tensors[1][8:16].tolist()       # 25 * 1 // 3 = 8 .. 25 * 2 // 3 = 16
    run.finish()


def test_a_per_iteration_scheduler_stepped_when_optimizer_step_says_so():
    """``if optimizer.step(): scheduler.step()`` with two accumulation rounds steps the user's
    scheduler once per global iteration, after its update: the LRs and weights of the hooks
    engine with its scheduler stepped after every iteration."""
    ds = data()

    def loop(config):
        loader = prepare_data_loader(ds)
        model = prepare_model(mlp())
        opt = prepare_optimizer(sgd(model.parameters()))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
        for _ in epochs(1, model=model, optimizer=opt, scheduler=sched):
            for x, y in loader:
                F.cross_entropy(model(x), y).backward()
                if opt.step():
                    sched.step()

    w, run = loop_worker(loop)
    torch.manual_seed(1)
    ref = IIDPWorker(mlp(), sgd, F.cross_entropy)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref.optimizer, lambda k: 1.0 / (1 + k))
    for worker in (w, ref):
        worker.configure(1, 1, 8)
    for it in range(4):
        mbs = micro(ds, torch.arange(it * 16, it * 16 + 16), [8, 8])
        w.train_step(mbs)
        run.after_step(epoch_end=False)
        ref.train_step(mbs)
        ref_sched.step()
        assert w.get_lr() == ref.get_lr() == pytest.approx(0.1 / (2 + it), rel=1e-12)
    for a, b in zip(w.model.parameters(), ref.model.parameters()):
        torch.testing.assert_close(a, b)
    assert run.extra_state()["scheduler"]["last_epoch"] == 4
    run.abandon()
