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
                if "views" in kw:
                    kw["views"].append(torch_view())
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


def torch_view():
    """What this side of the hand-over sees of torch's per-thread state."""
    return (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch._C._len_torch_function_stack(),
            torch._C._autograd._top_saved_tensors_default_hooks(True) is not None)


BASE = (True, False, torch.bfloat16, 0, False)         # a thread that entered nothing


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


def assert_same_optimizer_state(optimizers, references):
    """Each optimizer's state equals its reference's, parameter by parameter (and is not empty)."""
    for sub, ref in zip(optimizers, references, strict=True):
        pa = [p for g in sub.param_groups for p in g["params"]]
        pb = [p for g in ref.param_groups for p in g["params"]]
        for a, b in zip(pa, pb, strict=True):
            assert set(sub.state[a]) == set(ref.state[b]) != set()
            for k, v in ref.state[b].items():
                torch.testing.assert_close(torch.as_tensor(sub.state[a][k]), torch.as_tensor(v))


def scaler_loop(ds, steps, enabled=False, **scaler_kw):
    """Two optimizers (a body and a head) and a GradScaler, as an AMP loop writes them."""
    def loop(config):
        loader = prepare_data_loader(ds)
        model = prepare_model(mlp())
        opt_a, opt_b = prepare_optimizer(*two_optimizers(model))
        scaler = torch.amp.GradScaler("cpu", enabled=enabled, **scaler_kw)
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
    assert_same_optimizer_state(w.optimizer.optimizers, opts)
    assert set(run.extra_state()) == {"scaler"}          # the optimizers are the engine's
    run.finish()


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
    """precision="bf16": autocast is each side's own, so the loop's forward enters the engine's
    (the same bf16 losses and updates as the step_fn engine; an fp32 forward would differ
    by ~1e-2) and leaves it at ``backward()``: after it the loop sees a plain thread's state."""
    ds32 = torch.utils.data.TensorDataset(data().tensors[0].float(), data().tensors[1])
    torch.manual_seed(1)
    ref_model = mlp().float()
    views = []
    calls = LoopCallables(make_loop(ds32, lambda: mlp().float(), [], views=views), {"epochs": 1}, 1)
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
    # one batch per iteration (the VSWs batched); outside its forward, no engine autocast
    assert views == [BASE] * 2
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


# ---------------------------------------------------------------- the hand-over (a coroutine)
def test_each_side_keeps_its_own_torch_state_across_the_hand_overs():
    """The loop asks for every batch inside ``no_grad()``, an fp16 autocast block and
    ``torch.device("cpu")``, and calls ``backward()`` inside ``no_grad()``, the autocast block
    and ``saved_tensors_hooks``. Each side sees only its own state: the loop its blocks after
    every hand-over, the engine a plain thread's state between steps, and the engine's own
    autograd work (a ragged step: ``loss * n_i / B_L`` per VSW, then its backward) is done
    with grad on - the weights equal plain SGD on the union of the micro-batches."""
    ds, seen = data(), []
    keep = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    def loop(config):
        loader = prepare_data_loader(ds)
        model = prepare_model(mlp())
        opt = prepare_optimizer(sgd(model.parameters()))
        for _ in epochs(1, model=model, optimizer=opt):
            it = iter(loader)
            while True:
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16), torch.device("cpu"):
                    batch = next(it, None)
                    seen.append(("batch", torch_view()))
                if batch is None:
                    break
                loss = F.cross_entropy(model(batch[0]), batch[1])   # (float64: autocast casts nothing)
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16), keep:
                    loss.backward()
                    seen.append(("backward", torch_view()))
                opt.step()
                seen.append(("step", torch_view()))

    calls = LoopCallables(loop, None, 1)
    calls.dataset_fn()
    torch.manual_seed(1)
    w = IIDPWorker(calls.model_fn(), calls.optimizer_fn, None, step_fn=calls.step_fn)
    run = bridge.active()
    assert w.vsw_execution == "one_thread"          # the loop's step_fn runs on this thread only
    w.configure(2, 0, 4)
    torch.manual_seed(1)
    model = mlp()
    opt = sgd(model.parameters())
    X, y = ds.tensors
    for it, sizes in enumerate([[4, 3], [2, 4]]):            # ragged: weights 1, 3/4 and 1/2, 1
        idx = torch.arange(it * 8, it * 8 + sum(sizes))
        w.train_step(micro(ds, idx, sizes), ragged=True)
        assert torch_view() == BASE                    # while the loop waits inside its blocks
        run.after_step(epoch_end=it == 1)
        assert torch_view() == BASE
        opt.zero_grad()
        F.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()
    for a, b in zip(w.model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b)
    assert [k for k, _ in seen] == ["batch", "backward", "step"] * 4 + ["batch"]
    for kind, view in seen:
        assert view == {"batch": (False, True, torch.float16, 1, False),
                        "backward": (False, True, torch.float16, 0, True),
                        "step": BASE}[kind], kind
    run.finish()
    assert run.finished and torch_view() == BASE


def raising_loop(ds, cleanup):
    def train_loop_per_worker(config):
        loader = prepare_data_loader(ds)
        model = prepare_model(mlp())
        opt = prepare_optimizer(sgd(model.parameters()))
        for _ in epochs(1, model=model, optimizer=opt):
            for x, y in loader:
                with torch.no_grad():
                    try:
                        raise_on_the_first_batch(x)
                    finally:
                        cleanup.append(torch.is_grad_enabled())
    return train_loop_per_worker


def raise_on_the_first_batch(x):
    raise ZeroDivisionError(f"the user's error on {len(x)} samples")


def test_an_error_in_the_loop_names_the_loop_and_the_users_frame_and_leaves_the_engine_state():
    """An exception inside the user's loop (inside its ``no_grad()``) is raised by the engine's
    step as a one-line HookError naming ``train_loop_per_worker``, with the user's frames under
    it (and across pickling, as Ray carries it); the engine goes on with its own torch state."""
    import pickle

    from jabasray.errors import HookError

    ds, cleanup = data(), []
    w, run = loop_worker(raising_loop(ds, cleanup))
    w.configure(1, 0, 8)
    with pytest.raises(HookError) as info:
        w.train_step(micro(ds, torch.arange(8), [8]))
    for e in (info.value, pickle.loads(pickle.dumps(info.value))):
        assert str(e) == "train_loop_per_worker raised ZeroDivisionError: the user's error on 8 samples"
        frames = e.__notes__[0].splitlines()
        assert frames[0] == "your code, where it failed:"
        assert [ln.split(", in ")[-1] for ln in frames if ln.startswith("  File")] == [
            "train_loop_per_worker", "raise_on_the_first_batch"]
    assert cleanup == [False] and run.finished and torch_view() == BASE


def test_an_abandoned_or_killed_loop_unwinds_on_its_own_state_and_leaves_the_engines():
    """A loop waiting for its next batch inside ``no_grad()`` and ``torch.device("cpu")`` is
    unwound (its ``finally`` runs on its own state) when abandoned (a new placement) and when
    greenlet kills it (``GreenletExit`` thrown in, as when its thread ends); the engine's torch
    state is untouched either way."""
    def held_loop(ds, unwound):
        def loop(config):
            loader = prepare_data_loader(ds)
            model = prepare_model(mlp())
            opt = prepare_optimizer(sgd(model.parameters()))
            for _ in epochs(1, model=model, optimizer=opt):
                with torch.no_grad(), torch.device("cpu"):
                    try:
                        for x, y in loader:
                            pass
                    finally:
                        unwound.append(torch_view())
        return loop

    import greenlet

    ds = data()
    for how in ("abandon", "kill"):
        unwound = []
        calls = LoopCallables(held_loop(ds, unwound), None, 1)
        calls.dataset_fn()
        calls.model_fn()
        run = bridge.active()
        run.until("batch")                 # the loop waits inside no_grad(), device("cpu")
        assert torch_view() == BASE and unwound == []
        if how == "abandon":
            run.abandon()
        else:
            run.glet.throw(greenlet.GreenletExit)
        assert unwound == [(False, False, torch.bfloat16, 1, False)], how
        assert run.finished and torch_view() == BASE, how


def test_the_loop_runs_only_on_the_thread_that_started_it():
    """The engine issues a loop's steps from its own thread: per-VSW threads are refused for a
    loop's step_fn, and advancing a loop from another thread is a RuntimeError."""
    import threading

    ds = data()
    calls = LoopCallables(make_loop(ds, mlp, []), {"epochs": 1}, 1)
    calls.dataset_fn()
    with pytest.raises(ValueError, match="vsw_execution='threads' calls step_fn from one thread per VSW"):
        IIDPWorker(calls.model_fn(), calls.optimizer_fn, None, step_fn=calls.step_fn, vsw_execution="threads")
    run, errors = bridge.active(), []

    def other():
        try:
            run.until("batch")
        except RuntimeError as e:
            errors.append(str(e))
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors == ["train_loop_per_worker runs on the thread that started it; it cannot be "
                      "advanced from another thread"]
    run.abandon()
    assert run.finished


def test_a_hand_over_inside_inference_mode_is_a_one_line_value_error():
    ds = data()

    def loop(config):
        loader = prepare_data_loader(ds)
        model = prepare_model(mlp())
        opt = prepare_optimizer(sgd(model.parameters()))
        for _ in epochs(1, model=model, optimizer=opt):
            with torch.inference_mode():
                next(iter(loader))

    w, run = loop_worker(loop)
    w.configure(1, 0, 8)
    with pytest.raises(ValueError) as e:
        w.train_step(micro(ds, torch.arange(8), [8]))
    assert str(e.value) == ("train_loop_per_worker made a jabasray call ('batch') inside "
                            "torch.inference_mode(); leave it first")
    assert not torch.is_inference_mode_enabled() and run.finished


def test_a_swap_to_an_equal_state_keeps_the_mode_and_hook_stacks():
    """``torch_state.swap`` to a state equal to the current one (both sides inside the same
    ``torch.device`` block and ``saved_tensors_hooks``) leaves the thread's stacks as they were:
    capturing takes them off the thread, so they must be put back even when nothing differs."""
    from jabasray.train import torch_state

    with torch.device("cpu"), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        state = torch_state.capture()
        torch_state.apply(state, torch_state.capture())      # put back what capture took
        before = (torch._C._len_torch_function_stack(),
                  torch._C._autograd._top_saved_tensors_default_hooks(True))
        assert torch_state.swap(state) == state
        assert (torch._C._len_torch_function_stack(),
                torch._C._autograd._top_saved_tensors_default_hooks(True)) == before
    assert torch_view() == BASE
