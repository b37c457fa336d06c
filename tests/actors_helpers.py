"""Shared pieces of the Ray-layer tests: a hand-made profile (no profiling), a tiny job."""
from __future__ import annotations

import contextlib
import sys

import torch
from ray import cloudpickle

from jabasray.actors.driver import DriverCallback
from jabasray.data import load_digits_split
from jabasray.models import MLP
from jabasray.planners.perf_model import PerfModel
from jabasray.profiler.profile import AllReduceFit, BatchProfile, Profile


def profile(gpu_type: str, speed: float, min_local_batch: int = 4, max_local_batch: int = 32) -> Profile:
    """A plausible profile: compute linear in B_L, divided by speed; 4 VSWs fit."""
    batches = [BatchProfile(b, 4, 1e-3 * b / speed, 2.5e-3 * b / speed)
               for b in range(min_local_batch, max_local_batch + 1, min_local_batch)]
    fit = AllReduceFit(1.0, 1e-4)
    return Profile("test", gpu_type, min_local_batch, batches, 1e-3 / speed, 2e-4 / speed, [20000],
                   20000, fit, fit)


def perf_model(speeds: dict[str, float] | None = None, **kw) -> PerfModel:
    speeds = speeds or {"fast": 1.0, "slow": 0.5}
    return PerfModel({t: profile(t, s, **kw) for t, s in speeds.items()})


def model_fn():
    return MLP(64, (32,), 10)


def optimizer_fn(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def loss_fn(out, y):
    return torch.nn.functional.cross_entropy(out, y)


def step_failing_on_the_actors(model, batch):
    """The default step, but raising inside a GPU actor (not in the probe, which runs here)."""
    import ray

    x, y = batch
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        raise ZeroDivisionError("raised in the user's step")
    return torch.nn.functional.cross_entropy(model(x), y)


def metric_loss_fn(out, y):
    """``loss_fn`` with training metrics: ``label`` (the batch's mean target, known from the
    served indices alone: a reference for the sample-count reduction), ``acc`` and ``one``."""
    loss = torch.nn.functional.cross_entropy(out, y)
    return loss, {"label": y.double().mean(), "acc": (out.argmax(1) == y).double().mean(), "one": 1.0}


def tiny_data(n: int = 240):
    train, val = load_digits_split(image=False)
    X, y = train.tensors
    return torch.utils.data.TensorDataset(X[:n], y[:n]), val


class KillOnce(DriverCallback):
    """Test hook: ``ray.kill`` the actor of ``rank`` at interval ``interval`` (default 1) of
    epoch ``epoch``, once. Works in the driver's process, also when the driver is itself a Ray
    actor."""

    def __init__(self, epoch: int, rank: int, interval: int = 1) -> None:
        self.epoch, self.rank, self.interval, self.done = epoch, rank, interval, False

    def on_interval(self, driver, record):
        import ray
        if not self.done and record.epoch == self.epoch and record.interval == self.interval:
            self.done = True
            ray.kill(driver.gpu_actors()[self.rank], no_restart=True)


def start_cluster(cluster_cls, head: dict, nodes: list[dict], tries: int = 3):
    """A ``Cluster`` with ``head`` and ``nodes``; a raylet that does not register within Ray's
    30 s (an overloaded machine) shuts the attempt down and starts again, up to ``tries``."""
    for attempt in range(tries):
        c = cluster_cls(initialize_head=False)
        try:
            c.add_node(**head)
            for n in nodes:
                c.add_node(**n)
            return c
        except Exception:  # noqa: BLE001 - Ray's startup timeout is a bare Exception
            c.shutdown()
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def running_cluster(head: dict, nodes: list[dict]):
    """A started :func:`start_cluster` with Ray connected to it (one thread per worker), every
    node registered; Ray disconnected and the cluster shut down on exit."""
    import ray
    from ray.cluster_utils import Cluster

    c = start_cluster(Cluster, head, nodes)
    try:
        ray.init(address=c.address, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


class HeldRows(torch.utils.data.Dataset):
    """The rows of ``dataset``, read through a gate: every read appends one byte to the file
    ``<folder>/read`` (shared by every process of the test); the read that passes ``after`` rows
    creates ``<folder>/gate``, once per test, and every read waits while the gate exists (at most
    120 s). With ``after`` = one epoch + a few batches, a test holds a run mid-epoch 1 however
    fast or loaded the machine is, acts (kills a driver, removes a node), then ``release()``s.
    The batches are the rows themselves (stacked by ``default_collate``): training is the same
    as on ``dataset``."""

    def __init__(self, dataset, folder, after: int) -> None:
        import os
        self.dataset, self.after = dataset, after
        self.read, self.gate, self.once = (os.path.join(str(folder), n) for n in ("read", "gate", "once"))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        import os
        import time
        fd = os.open(self.read, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, b"x")
        os.close(fd)
        if os.path.getsize(self.read) > self.after:
            try:
                os.close(os.open(self.once, os.O_CREAT | os.O_EXCL))
                open(self.gate, "w").close()
            except FileExistsError:
                pass
        t0 = time.monotonic()
        while os.path.exists(self.gate) and time.monotonic() - t0 < 120:
            time.sleep(0.02)
        return self.dataset[i]

    def wait_held(self, timeout: float = 120.0) -> None:
        """Block until the gate is closed (the run is held), or fail after ``timeout`` s."""
        import os
        import time
        t0 = time.monotonic()
        while not os.path.exists(self.gate):
            assert time.monotonic() - t0 < timeout, f"the run never read {self.after} rows"
            time.sleep(0.02)

    def release(self) -> None:
        import os
        os.remove(self.gate)


# Ray workers cannot import this test helper module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def assert_each_sample_once_per_epoch(history, dataset_size: int) -> None:
    """Every epoch of ``history`` trained on each of the ``dataset_size`` samples exactly once,
    by the indices the actors report they served (``DriverOptions(record_samples=True)``), and
    the driver's own digest check agrees."""
    for e in history.epochs:
        served = [i for rec in history.intervals if rec.epoch == e.epoch for i in rec.served]
        assert sorted(served) == list(range(dataset_size)), f"epoch {e.epoch}"
        assert e.served_exactly_once is True, f"epoch {e.epoch}"
