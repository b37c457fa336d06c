"""Data path and LR schedule of a GPU actor, in this process (no Ray): a DataLoader over files
reads exactly the sampler's samples (same batches as in memory), every sample once per epoch
across B_L/layout changes and a state hand-over; the LR trajectory is the torch scheduler's
times the batch-size factor; validation shards reduce to the whole-set metrics; bad hooks fail
with one line."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from actors_helpers import model_fn
from jabasray.actors.gpu_actor import GPUActor, IntervalRequest
from jabasray.actors.hooks import JobHooks, probe_job
from jabasray.actors.metrics import reduce_metrics
from jabasray.actors.placement import Slot
from jabasray.actors.rendezvous import Rendezvous
from jabasray.adaptive import lr_factor
from jabasray.config import JobConfig
from jabasray.engine.evaluation import default_eval_fn, evaluate_shard
from jabasray.engine.loader import InMemoryBatches, LoaderBatches, split_batch
from jabasray.engine.sampler import epoch_permutation
from realjobs_helpers import FileDataset, IndexedFileDataset, in_memory_copy, write_sample_files

N = 600


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_sample_files(tmp_path_factory.mktemp("files"), N)


def sgd(p):
    return torch.optim.SGD(p, lr=0.02, momentum=0.9)


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_reads_the_planned_indices_like_the_in_memory_path(files, workers):
    mem = InMemoryBatches(in_memory_copy(N))
    loader = LoaderBatches(FileDataset(files), num_workers=workers)
    plans = [[np.array([5, 3, 599]), np.array([], dtype=np.int64), np.arange(10, 30)],
             [np.array([7]), np.arange(100, 164)]]        # two passes: persistent workers
    try:
        for plan in plans:
            got = list(loader.batches(plan))
            want = list(mem.batches(plan))
            assert len(got) == len(plan)
            for g, w, idx in zip(got, want, plan):
                assert len(g[0]) == len(idx)
                assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])
    finally:
        loader.close()


def test_split_batch_keeps_structure_and_slices_per_sample_lists():
    batch = {"x": torch.arange(10).reshape(5, 2), "name": ["a", "b", "c", "d", "e"],
             "pair": (torch.arange(5), torch.zeros(5))}
    parts = split_batch(batch, [2, 0, 3])
    assert [p["name"] for p in parts] == [["a", "b"], [], ["c", "d", "e"]]
    assert torch.equal(parts[2]["x"], torch.arange(4, 10).reshape(3, 2))
    assert torch.equal(parts[0]["pair"][0], torch.tensor([0, 1])) and len(parts[1]["pair"][1]) == 0


def _actor(files, rank=0, world=1, hooks=None, job=None, **hk):
    slot = Slot(rank=rank, node="n0", gpu_type="fast", speed=1.0, group=rank % 2, pair=rank // 2)
    hooks = hooks or JobHooks(dataset_fn=lambda: FileDataset(files), **hk)
    a = GPUActor(slot, world, job or JobConfig(seed=4), model_fn, sgd,
                 lambda o, y: F.cross_entropy(o, y), None, "cpu", False,
                 torch_threads=torch.get_num_threads(), hooks=hooks)
    return a


def _req(epoch, cursor, n, bl, layout, iteration, **kw):
    return IntervalRequest(epoch=epoch, cursor=cursor, num_iterations=n, local_batch=bl,
                           layout=layout, iteration=iteration, base_lr=None, base_batch=16,
                           lr_scaling=kw.pop("lr_scaling", "sqrt"),
                           warmup_iterations=kw.pop("warmup", 0), similarity=False, **kw)


SCHEDULE = [(4, 1, 1, 3), (8, 2, 1, 4), (4, 1, 3, 5), (12, 1, 2, 100)]   # (B_L, n_vsw, n_ga, iterations)


def _run_epoch(actor, epoch, cursor, iteration, served, upto=None):
    """Intervals of SCHEDULE (B_L and layout change between them) until the epoch ends."""
    for k, (bl, vsw, ga, iters) in enumerate(SCHEDULE):
        if upto is not None and k == upto:
            break
        actor.configure(vsw, ga, bl)
        rep = actor.run_interval(_req(epoch, cursor, iters, bl, [vsw * (ga + 1)], iteration))
        cursor, iteration = rep.end_cursor, iteration + rep.num_iterations
        if cursor >= N:
            break
    return cursor, iteration


def test_dataloader_path_serves_every_sample_once_per_epoch_across_layouts_and_handover(files):
    """Two epochs; B_L and the layout change between intervals; mid-epoch 1 the state moves to
    a NEW actor (re-placement/resume: state_dict -> load_state_dict, cursor carried). Every
    sample is served once per epoch."""
    served: list[int] = []

    def step(model, batch):
        served.extend(batch["index"].tolist())
        return F.cross_entropy(model(batch["x"]), batch["y"])

    hooks = JobHooks(dataset_fn=lambda: IndexedFileDataset(files), step_fn=step, num_data_workers=1)
    a = _actor(files, hooks=hooks)
    a.setup(Rendezvous("127.0.0.1", 29500, 1))
    cursor, it = _run_epoch(a, 0, 0, 0, served)
    assert cursor == N
    cursor, it = _run_epoch(a, 1, 0, it, served, upto=2)          # part of epoch 1
    state = a.state_dict()
    a.shutdown()
    b = _actor(files, hooks=hooks)
    b.setup(Rendezvous("127.0.0.1", 29500, 1))
    b.load_state_dict(state)
    for bl, vsw, ga, iters in SCHEDULE[2:]:
        b.configure(vsw, ga, bl)
        rep = b.run_interval(_req(1, cursor, iters, bl, [vsw * (ga + 1)], it))
        cursor, it = rep.end_cursor, it + rep.num_iterations
    b.shutdown()
    assert cursor == N
    # VSW threads interleave within an iteration: compare each epoch as a multiset, and the
    # first interval (one worker, 3 x 4 samples, no threads) in the permutation's order
    assert sorted(served[:N]) == list(range(N)) and sorted(served[N:]) == list(range(N))
    assert served[:12] == epoch_permutation(4, 0, N)[:12].tolist()


@pytest.mark.parametrize("interval", ["iteration", "epoch"])
def test_lr_trajectory_is_the_torch_schedulers_times_the_batch_size_factor(files, interval):
    """Cosine (per iteration) or step decay (per epoch) on the user's Adam(lr=3e-3) with warm-up
    and sqrt scaling: every update's LR = scheduler's LR x lr_factor(B_G*, iteration). The
    scheduler's state survives a hand-over to a new actor mid-epoch."""
    if interval == "iteration":
        make = lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=150)  # noqa: E731
    else:
        make = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # noqa: E731
    adam = lambda p: torch.optim.Adam(p, lr=3e-3)  # noqa: E731
    hooks = JobHooks(dataset_fn=lambda: FileDataset(files), lr_scheduler_fn=make,
                     lr_scheduler_interval=interval)

    def new_actor():
        slot = Slot(rank=0, node="n0", gpu_type="fast", speed=1.0, group=0, pair=0)
        a = GPUActor(slot, 1, JobConfig(seed=4), model_fn, adam, lambda o, y: F.cross_entropy(o, y),
                     None, "cpu", False, torch_threads=1, hooks=hooks)
        a.setup(Rendezvous("127.0.0.1", 29500, 1))
        return a

    ref_opt = adam(model_fn().parameters())
    ref = make(ref_opt)
    a = new_actor()
    expected, got = [], []
    it = 0
    for epoch in range(2):
        cursor = 0
        for k, (bl, vsw, ga, iters) in enumerate(SCHEDULE):
            if epoch == 1 and k == 2:                       # re-placement mid-epoch
                state = a.state_dict()
                a.shutdown()
                a = new_actor()
                a.load_state_dict(state)
            a.configure(vsw, ga, bl)
            bg = bl * vsw * (ga + 1)
            rep = a.run_interval(_req(epoch, cursor, iters, bl, [vsw * (ga + 1)], it, warmup=5))
            for j in range(rep.num_iterations):
                expected.append(ref_opt.param_groups[0]["lr"] *
                                lr_factor(16, bg, "sqrt", iteration=it + j, warmup_iterations=5))
                last = cursor + (j + 1) * bg >= N
                if interval == "iteration" or last:
                    ref_opt.step()
                    ref.step()
            got += rep.lrs
            cursor, it = rep.end_cursor, it + rep.num_iterations
            if cursor >= N:
                break
    a.shutdown()
    assert len(got) == it and len(set(round(x, 12) for x in got)) > 10
    assert got == pytest.approx(expected, rel=1e-12)


def test_optimizers_own_lr_is_the_lr_at_the_initial_global_batch(files):
    """No scheduler, B_G* = initial_global_batch: the update uses exactly the optimizer's LR
    (0.02), not any JobConfig default."""
    a = _actor(files)
    a.setup(Rendezvous("127.0.0.1", 29500, 1))
    a.configure(1, 3, 4)                                      # 16 = base_batch
    rep = a.run_interval(_req(0, 0, 3, 4, [4], 0, lr_scaling="linear"))
    assert rep.lrs == [0.02, 0.02, 0.02]
    a.configure(1, 7, 4)                                      # 32 = 2 x base_batch
    rep = a.run_interval(_req(0, rep.end_cursor, 2, 4, [8], 3, lr_scaling="linear"))
    assert rep.lrs == [0.04, 0.04]
    assert a.worker.optimizer.param_groups[0]["lr"] == 0.02
    a.shutdown()


def test_sharded_validation_reduces_to_the_whole_set_metrics(files):
    """Default eval (loss, top-1, top-5) over 3 uneven shards, combined by sample counts,
    equals the evaluation of the whole set at once."""
    torch.manual_seed(0)
    model = model_fn()
    ds = in_memory_copy(N)
    src = InMemoryBatches(ds)
    fn = default_eval_fn(F.cross_entropy, topk=(1, 5))
    whole, n = evaluate_shard(model, src.batches([np.arange(N)]), fn, torch.device("cpu"))
    assert n == N and set(whole) == {"loss", "accuracy", "top5"}
    shards = [evaluate_shard(model, src.batches([np.arange(a, b)]), fn, torch.device("cpu"))
              for a, b in [(0, 7), (7, 7), (7, 600)]]
    assert shards[1] == ({}, 0)
    assert reduce_metrics(shards) == pytest.approx(whole, rel=1e-6)


def test_bad_hooks_fail_before_training_with_one_line(files, tmp_path):
    ok = dict(model_fn=model_fn, optimizer_fn=sgd, loss_fn=F.cross_entropy)
    cases = [
        (JobHooks(dataset_fn=lambda: FileDataset(tmp_path)), r"^dataset_fn returned an empty dataset \(len 0\)$"),
        (JobHooks(dataset_fn=lambda: 5), r"^dataset_fn must return a map-style Dataset .*got int: 5$"),
        (JobHooks(dataset_fn=lambda: FileDataset(files),
                  step_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")),
         r"^step_fn must return a scalar loss tensor, got a tensor of shape \(2,\)$"),
        (JobHooks(dataset_fn=lambda: FileDataset(files), step_fn=lambda m, b: 0.5),
         r"^step_fn must return a scalar loss tensor, got float: 0.5$"),
        (JobHooks(dataset_fn=lambda: FileDataset(files), val_dataset_fn=lambda: FileDataset(files),
                  eval_fn=lambda m, b: 0.9), r"^eval_fn must return a non-empty dict\[str, float\], got float: 0.9$"),
        (JobHooks(dataset_fn=lambda: FileDataset(files), val_dataset_fn=lambda: FileDataset(files),
                  eval_fn=lambda m, b: {"acc": "high"}), r"^eval_fn must return a dict\[str, float\], got \{'acc': 'high'\}$"),
        (JobHooks(dataset_fn=lambda: FileDataset(files), lr_scheduler_fn=lambda o: 3),
         r"^lr_scheduler_fn must return a torch LR scheduler .*got int$"),
    ]
    for hooks, pattern in cases:
        report = probe_job(hooks=hooks, **ok)
        assert report.error is not None and "\n" not in report.error
        assert __import__("re").match(pattern, report.error), report.error
    good = probe_job(hooks=JobHooks(dataset_fn=lambda: FileDataset(files),
                                    val_dataset_fn=lambda: FileDataset(files)), **ok)
    assert good.error is None and good.dataset_size == N and good.optimizer_lr == 0.02
