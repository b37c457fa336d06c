"""The user's job on the IIDP engine (no Ray): a custom step_fn is the default step, the LR is
the optimizer's own times the batch-size factor, gradient clipping equals clipping the plain
large-batch gradient (also across two gloo processes with different layouts), mixed precision."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from engine_reference import make_data, make_model, max_rel_diff, split
from jabasray.engine import IIDPWorker


def sgd(p):
    return torch.optim.SGD(p, lr=0.1, momentum=0.9)


def dict_step(model, batch):
    """A step on dict batches with an auxiliary term (0 * sum of logits keeps it equal)."""
    out = model(batch["image"])
    return F.cross_entropy(out, batch["label"]) + 0.0 * out.sum()


@pytest.mark.parametrize("method", ["sws", "ows"])
def test_custom_step_fn_equals_default_step_with_vsws_and_ga(method):
    """2 VSWs x 2 GA steps, three steps and a ragged one: a dict-batch step_fn trains exactly
    like the default ``loss_fn(model(x), y)`` on the same samples."""
    a = IIDPWorker(make_model(0), sgd, F.cross_entropy, weight_sync=method)
    b = IIDPWorker(make_model(0), sgd, None, weight_sync=method, step_fn=dict_step)
    for w in (a, b):
        w.configure(2, 1, 4)
    for step, sizes in enumerate([[4] * 4, [4] * 4, [4] * 4, [3, 0, 2, 1]]):
        X, y = make_data(step, sum(sizes))
        pairs = split(X, y, sizes)
        la = a.train_step(pairs, ragged=step == 3).loss
        lb = b.train_step([{"image": x, "label": t} for x, t in pairs], ragged=step == 3).loss
        assert la == pytest.approx(lb, rel=1e-6)
    assert max_rel_diff(b.model, a.model) < 1e-6


def test_step_fn_returning_a_non_scalar_is_a_one_line_error():
    w = IIDPWorker(make_model(0), sgd, None, step_fn=lambda m, b: F.cross_entropy(
        m(b[0]), b[1], reduction="none"))
    w.configure(1, 0, 4)
    X, y = make_data(0, 4)
    with pytest.raises(ValueError, match=r"^step_fn must return a scalar loss tensor, got a tensor "
                                         r"of shape \(4,\)$"):
        w.train_step([(X, y)])


def test_lr_factor_multiplies_the_optimizers_own_lr_only_for_the_update():
    """The update is SGD at lr * factor; the optimizer's param group keeps the user's LR (what
    their scheduler and their checkpoint see)."""
    w = IIDPWorker(make_model(0), lambda p: torch.optim.SGD(p, lr=0.01), F.cross_entropy)
    w.configure(1, 0, 8)
    w.lr_factor = 2.5
    ref = make_model(0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.025)
    for step in range(3):
        X, y = make_data(step, 8)
        w.train_step([(X, y)])
        opt.zero_grad()
        F.cross_entropy(ref(X), y).backward()
        opt.step()
    assert w.optimizer.param_groups[0]["lr"] == 0.01 and w.effective_lr() == pytest.approx(0.025)
    assert max_rel_diff(w.model, ref) < 1e-6


def _clipped_reference(sizes_per_step, clip, seed0=50):
    ref = make_model(0)
    opt = sgd(list(ref.parameters()))
    norms = []
    for step, n in enumerate(sizes_per_step):
        X, y = make_data(seed0 + step, n)
        opt.zero_grad()
        F.cross_entropy(ref(X), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        opt.step()
    return ref, norms


@pytest.mark.parametrize("method", ["sws", "ows"])
def test_clipped_update_equals_plain_large_batch_clipped_update(method):
    """One device, 2 VSWs x 2 GA: clipping the averaged gradient equals clipping the plain
    step's gradient on the union batch (OWS is replaced by SWS: the norm needs all buckets)."""
    clip = 0.5
    w = IIDPWorker(make_model(0), sgd, F.cross_entropy, weight_sync=method, grad_clip_norm=clip,
                   bucket_cap_mb=0.0005)
    assert w.weight_sync_method == "sws"
    w.configure(2, 1, 4)
    for step in range(3):
        X, y = make_data(50 + step, 16)
        w.train_step(split(X, y, [4] * 4))
    ref, norms = _clipped_reference([16] * 3, clip)
    assert min(norms) > clip, "the test must actually clip"
    assert max_rel_diff(w.model, ref) < 1e-5


def _clip_worker(rank: int, world: int, init_file: str, out_dir: str, clip: float) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        w = IIDPWorker(make_model(0), sgd, F.cross_entropy, process_group=dist.group.WORLD,
                       weight_sync="ows", grad_clip_norm=clip, bucket_cap_mb=0.0005)
        layouts = [(2, 1), (1, 0)]            # rank 0: 4 workers, rank 1: 1 worker
        w.configure(*layouts[rank], 4)
        for step in range(3):
            X, y = make_data(50 + step, 20)
            mine = X[:16], y[:16]
            if rank == 1:
                mine = X[16:], y[16:]
            w.train_step(split(*mine, [4] * (4 if rank == 0 else 1)))
        torch.save(w.model.state_dict(), os.path.join(out_dir, f"clip{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_process_clipping_after_the_all_reduce_equals_plain_clipped_step(tmp_path):
    """Two gloo ranks with 4 and 1 decoupled workers: the clip acts on the all-reduced mean
    (both ranks end identical and equal to the plain clipped step on the 20-sample union)."""
    clip = 0.5
    mp.spawn(_clip_worker, args=(2, str(tmp_path / "store"), str(tmp_path), clip), nprocs=2, join=True)
    ref, norms = _clipped_reference([20] * 3, clip)
    assert min(norms) > clip
    for r in range(2):
        m = make_model(1)
        m.load_state_dict(torch.load(tmp_path / f"clip{r}.pt", weights_only=True))
        assert max_rel_diff(m, ref) < 1e-5, r


def test_bf16_autocast_trains_close_to_fp32():
    a = IIDPWorker(make_model(0), sgd, F.cross_entropy)
    b = IIDPWorker(make_model(0), sgd, F.cross_entropy, precision="bf16")
    for w in (a, b):
        w.configure(1, 1, 8)
    for step in range(3):
        X, y = make_data(step, 16)
        la = a.train_step(split(X, y, [8, 8])).loss
        lb = b.train_step(split(X, y, [8, 8])).loss
        assert lb == pytest.approx(la, rel=0.05)
    assert 0 < max_rel_diff(b.model, a.model) < 0.05      # bf16 did run (not bit-equal)


def test_fp16_grad_scaler_skips_inf_steps_and_is_checkpointed():
    """fp16: the GradScaler scales the loss, skips an update whose gradient overflowed (weights
    unchanged, scale halved) and its state round-trips through state_dict."""
    w = IIDPWorker(make_model(0), sgd, F.cross_entropy, precision="fp16")
    w.configure(1, 0, 8)
    X, y = make_data(0, 8)
    w.train_step([(X, y)])
    scale = w.state_dict()["grad_scaler"]["scale"]
    before = {k: v.clone() for k, v in w.model.state_dict().items()}
    w.train_step([(X * float("inf"), y)])              # overflow: the update is skipped
    assert all(torch.equal(before[k], v) for k, v in w.model.state_dict().items())
    state = w.state_dict()
    assert state["grad_scaler"]["scale"] == scale / 2
    fresh = IIDPWorker(make_model(3), sgd, F.cross_entropy, precision="fp16")
    fresh.load_state_dict(state)
    assert fresh.state_dict()["grad_scaler"]["scale"] == scale / 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fp16_grad_scaler_and_pinned_loader_match_the_plain_amp_loop():
    """CUDA: batches from a pinned-memory DataLoader, fp16 autocast + GradScaler, 2 VSWs x 1 GA
    and clipping: the same weights as the plain torch.amp loop on the union batch."""
    from jabasray.engine.loader import LoaderBatches

    dev = torch.device("cuda")
    X, y = make_data(0, 64)
    ds = torch.utils.data.TensorDataset(X, y)
    loader = LoaderBatches(ds, num_workers=1, pin_memory=True)
    w = IIDPWorker(make_model(0), sgd, F.cross_entropy, device=dev, precision="fp16", grad_clip_norm=1.0)
    w.configure(2, 1, 8)
    ref = make_model(0).to(dev)
    opt = sgd(list(ref.parameters()))
    scaler = torch.amp.GradScaler("cuda")
    plan = [torch.arange(k * 32, (k + 1) * 32) for k in range(2)]
    for batch in loader.batches(plan):
        assert batch[0].is_pinned()
        xb, yb = (t.to(dev, non_blocking=True) for t in batch)
        w.train_step(split(xb, yb, [8] * 4))
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = sum(F.cross_entropy(ref(xb[i:i + 8]), yb[i:i + 8]) for i in range(0, 32, 8)) / 4
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    loader.close()
    assert max_rel_diff(w.model, ref) < 2e-3
    assert w.state_dict()["grad_scaler"]["scale"] == scaler.get_scale()
