"""Faults that must neither hang nor stop a run, and profiling on the GPUs, on a
``ray.cluster_utils.Cluster`` of two raylets (a head with 2 CPUs and 2 emulated "fast" GPUs, a
node with 1 CPU and 2 emulated "slow" ones).

Proves: a GPU actor that blocks forever inside the user's step becomes an actor failure naming
the hung ranks within the call's deadline (not after the collective timeout), every actor is
killed and the epoch is redone on the same allocation, losing no completed epoch and serving
every sample once; the actors' environment (``DriverOptions.actor_env``) reaches their process
and gloo (an interface that does not exist makes every rendezvous fail), and a failed rendezvous
is an actor failure counted against ``max_failures``, ending in one line; the rendezvous store
listens on the first free port of ``rendezvous_ports``; placement bundles reserve the data
loaders' CPUs, and a placement that cannot be met ends with PlacementTimeout naming what is
missing; each GPU type is profiled in a Ray task holding one GPU of that type (asserted from
the task's assigned resources), cached per type in the run's profile folder, and a driver with
``profile_in_tasks`` plans with those profiles.
"""
from __future__ import annotations

import os
import socket
import sys
import time

import pytest
from ray import cloudpickle

from actors_helpers import (HeldRows, assert_each_sample_once_per_epoch, loss_fn, model_fn,
                            optimizer_fn, perf_model, running_cluster, tiny_data)
from jabasray.actors.driver import DriverCallback, DriverOptions, JabasDriver
from jabasray.actors.hooks import JobHooks
from jabasray.actors.placement import place_actors, release, slots_for
from jabasray.config import FailureConfig, JobConfig
from jabasray.errors import JobFailed, PlacementTimeout
from jabasray.types import ClusterSpec, NodeSpec

pytestmark = pytest.mark.multinode


@pytest.fixture(scope="module")
def cluster(without_session_ray):
    with running_cluster(dict(num_cpus=2, include_dashboard=False, resources={"gpu_fast": 2}),
                         [dict(num_cpus=1, resources={"gpu_slow": 2})]) as c:
        yield c


FOUR = ClusterSpec(nodes=[NodeSpec("f", "fast", 2, speed=1.0), NodeSpec("s", "slow", 2, speed=0.5)])
# One GPU of each type on each node: still a job across both nodes and both types, with half the
# GPU-actor processes to start (each costs seconds of CPU on a small test machine).
TWO = ClusterSpec(nodes=[NodeSpec("f", "fast", 1, speed=1.0), NodeSpec("s", "slow", 1, speed=0.5)])
SPEEDS = {"fast": 1.0, "slow": 0.5}


def job(epochs: int = 2, **kw) -> JobConfig:
    return JobConfig(epochs=epochs, initial_global_batch=32, min_global_batch=16,
                     max_global_batch=64, min_local_batch=4, adapt_interval=2, autoscale=False,
                     seed=1, **kw)


class HangOnce:
    """The user's step, which blocks for an hour in the first step after ``armed`` appears, in
    one actor only (the one that creates ``taken`` first)."""

    def __init__(self, armed: str, taken: str) -> None:
        self.armed, self.taken = armed, taken

    def __call__(self, model, batch):
        if os.path.exists(self.armed):
            try:
                os.close(os.open(self.taken, os.O_CREAT | os.O_EXCL))
                time.sleep(3600)
            except FileExistsError:
                pass
        inputs, targets = batch
        return loss_fn(model(inputs), targets)


class Arm(DriverCallback):
    """Arms the hang after interval 0 of ``epoch``; records events with their times."""

    def __init__(self, armed: str, epoch: int) -> None:
        self.armed, self.epoch = armed, epoch
        self.t_armed: float | None = None
        self.events: list[tuple[float, str]] = []

    def on_interval(self, drv, record):
        if self.t_armed is None and record.epoch == self.epoch and record.interval == 0:
            open(self.armed, "w").close()
            self.t_armed = time.monotonic()

    def on_event(self, drv, message):
        self.events.append((time.monotonic(), message))


class Env(DriverCallback):
    """At the first interval: each actor's values of ``names`` and the rendezvous port."""

    def __init__(self, names: list[str]) -> None:
        self.names, self.env, self.port = names, None, None

    def on_interval(self, drv, record):
        import ray
        if self.env is None:
            names = self.names
            self.env = ray.get([a.__ray_call__.remote(lambda _self: {k: os.environ.get(k) for k in names})
                                for a in drv.gpu_actors()])
            self.port = drv.pool._rdv.info.port


def free_port_range(n: int = 8) -> tuple[int, int]:
    """A range of ``n`` ports whose first one is free now."""
    s = socket.socket()
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    return (port, port + n - 1) if port + n - 1 <= 65535 else (port - n + 1, port)


ENV = {"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}


@pytest.fixture(scope="module")
def hung_run(cluster, tmp_path_factory):
    """One run shared by the hang test and the actor-environment test (each checks its own facts
    of it; one run instead of two saves a driver and two GPU-actor processes): one actor blocks
    in its step in epoch 1; the actors get ``ENV`` (``actor_env``) and the rendezvous store a
    port range. ``(drv, hist, hook, seen, ports, tmp)``."""
    tmp = tmp_path_factory.mktemp("hang")
    ds, val = tiny_data(240)
    hook = Arm(str(tmp / "armed"), epoch=1)
    ports = free_port_range()
    seen = Env(list(ENV) + ["OMP_NUM_THREADS"])
    drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job(), TWO, tmp / "hang",
                      val_dataset=val, perf_model=perf_model(SPEEDS),
                      hooks=JobHooks(step_fn=HangOnce(str(tmp / "armed"), str(tmp / "taken"))),
                      callbacks=[hook, seen],
                      options=DriverOptions(failure_grace_s=5, call_timeout_s=5,
                                            collective_timeout_s=120, record_samples=True,
                                            actor_env=ENV, rendezvous_ports=ports))
    hist = drv.run()
    return drv, hist, hook, seen, ports, tmp


def test_a_hung_actor_is_a_failure_at_its_deadline_and_the_epoch_is_redone(hung_run):
    """One actor blocks in its step in epoch 1 (the other one waits for it in the gradient
    all-reduce). The interval's deadline (call_timeout_s=5; the collective timeout is 120 s)
    turns it into one actor failure naming the ranks still running; the driver kills every
    actor, restarts epoch 1 from its checkpoint on the same allocation (a hang drops no GPU
    pair) and finishes: epoch 0 kept, each epoch served every sample exactly once."""
    drv, hist, hook, _, _, tmp = hung_run
    assert os.path.exists(tmp / "taken")                   # the hang happened
    fail = [(t, m) for t, m in hook.events if "failure" in m]
    assert len(fail) == 1
    t_fail, msg = fail[0]
    assert "ActorHung" in msg and "run_interval on rank(s) [" in msg and "within 5s" in msg
    assert t_fail - hook.t_armed >= 5                      # not before its deadline
    assert "restarting epoch 2" in msg
    assert [e.epoch for e in hist.epochs] == [0, 1]
    assert hist.epochs[1].allocation == hist.epochs[0].allocation == {"f": 1, "s": 1}
    assert_each_sample_once_per_epoch(hist, 240)
    assert drv.gpu_actors() == []


def test_actor_env_reaches_the_actors_and_the_store_listens_in_the_port_range(hung_run):
    """The hang test's run (its actors got ``actor_env`` and its store ``rendezvous_ports``),
    read at its first interval: every actor's process has ``ENV``, and the store listens on a
    port of the range."""
    _, hist, _, seen, ports, _ = hung_run
    assert len(hist.epochs) == 2 and seen.env is not None
    # the job's own runtime_env (OMP_NUM_THREADS) is kept beside actor_env
    assert seen.env == [dict(ENV, OMP_NUM_THREADS="1")] * 2
    assert ports[0] <= seen.port <= ports[1]


def test_a_rendezvous_that_fails_is_an_actor_failure_and_ends_in_one_line(cluster, tmp_path):
    """GLOO_SOCKET_IFNAME names no interface: every actor fails to join the process group
    (RendezvousFailed), the driver recovers once (max_failures=1), fails again and gives up with
    a one-line JobFailed that says what happened."""
    ds, _ = tiny_data(240)
    drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job(1), TWO, tmp_path / "rdv",
                      perf_model=perf_model(SPEEDS), failure=FailureConfig(max_failures=1),
                      options=DriverOptions(actor_env={"GLOO_SOCKET_IFNAME": "nosuchif0"},
                                            collective_timeout_s=20, call_timeout_s=30))
    with pytest.raises(JobFailed) as info:
        drv.run()
    msg = str(info.value)
    assert "\n" not in msg and "giving up after 2 GPU actor failures" in msg
    assert "RendezvousFailed" in msg
    assert drv.gpu_actors() == []


class Where:
    def ping(self) -> bool:
        return True


def test_bundles_reserve_loader_cpus_and_an_unmet_placement_names_what_is_missing(cluster):
    """One pair with 1 loader CPU per GPU: both bundles hold {gpu_fast: 1, CPU: 1} and the
    actors hold the CPU (it is gone from the cluster's free CPUs while they live). Two pairs
    with 2 CPUs per GPU need 8 CPUs of a 3-CPU cluster: PlacementTimeout, one line."""
    import ray

    remote = ray.remote(num_cpus=0)(Where)
    make = lambda slot, opts: remote.options(**opts).remote()   # noqa: E731
    slots = slots_for(ClusterSpec(nodes=[NodeSpec("n0", "fast", 2)]), {"n0": 2})   # the head: two GPUs
    free_before = ray.available_resources().get("CPU", 0)
    placement, _ = place_actors(slots, make, emulate=True, timeout_s=60, cpus=1)
    try:
        assert ray.get([a.ping.remote() for a in placement.actors]) == [True, True]
        pg = next(iter(placement.pairs.values()))[0]
        table = ray.util.placement_group_table(pg)
        assert list(table["bundles"].values()) == [{"gpu_fast": 1.0, "CPU": 1.0}] * 2
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU", 0) > free_before - 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("CPU", 0) == free_before - 2
    finally:
        release(placement)
    with pytest.raises(PlacementTimeout) as info:
        # never met (8 CPUs of 3), whatever the wait: 1 s of waiting shows it as well as 3 s
        place_actors(slots_for(FOUR, {"f": 2, "s": 2}), make, emulate=True, timeout_s=1, cpus=2)
    msg = str(info.value)
    assert "\n" not in msg and "node f" in msg and "'CPU'" in msg and "missing" in msg


def test_each_gpu_type_is_profiled_in_a_task_holding_one_gpu_of_it(cluster, host_measurements, tmp_path):
    """profile_in_tasks: one task per type, each holding exactly one unit of its type's resource
    (and nothing else), on the node that has it; profiles for both types, the slow one slower;
    a second call reads both from the per-type cache without a task. A driver with
    profile_in_tasks then plans with the cached profiles and trains. The tasks read this host's
    all-reduce fit and contention from a host cache (``host_cache_dir``, seeded with the
    session's measurements: every raylet of the module runs on this host) instead of each
    measuring them with gloo child processes: neither is what this test checks."""
    import ray

    from jabasray.actors.profiling import profile_in_tasks

    ds, val = tiny_data(240)
    rows = ds
    # B_L up to 8 (the job's max_local_batch, so the driver reads the same cache entries): two
    # profiled batch sizes instead of eight, which is all the profiling, caching and planning
    # checked here need (and fewer points for the placed actors' step probe)
    small = job(1, max_local_batch=8)
    kw = dict(loss_fn=loss_fn, optimizer_fn=optimizer_fn, device="cpu", emulate=True,
              min_local_batch=4, max_local_batch=small.max_local_batch, weight_sync=small.weight_sync,
              bucket_cap_mb=25.0, cache_dir=tmp_path / "prof")
    host = str(host_measurements(tmp_path / "host"))
    notes: list[str] = []
    profiles = profile_in_tasks(model_fn, rows, FOUR, notes=notes, host_cache_dir=host, **kw)
    assert sorted(profiles) == ["fast", "slow"]
    assert all(p.gpu_type == t for t, p in profiles.items())
    slow_node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "gpu_slow" in n["Resources"])
    fast_node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "gpu_fast" in n["Resources"])
    assert sorted(notes) == sorted([
        f"profile of fast: measured in a Ray task holding {{'gpu_fast': 1.0}} on node {fast_node[:8]}",
        f"profile of slow: measured in a Ray task holding {{'gpu_slow': 1.0}} on node {slow_node[:8]}"])
    assert (profiles["fast"].speed, profiles["slow"].speed) == (1.0, 0.5)   # emulation scaling
    assert all([b.local_batch for b in p.batches] == [4, 8] for p in profiles.values())
    # the host measurements came from the host cache, not from a measurement in the task
    from jabasray.profiler.contention import cached_contention
    from jabasray.profiler.measure import cached_allreduce_fit
    fit, contention = cached_allreduce_fit(host), cached_contention(host)
    assert all(p.allreduce_intra == fit and p.contention == contention for p in profiles.values())
    again: list[str] = []
    assert profile_in_tasks(model_fn, rows, FOUR, notes=again, **kw) == profiles
    assert sorted(n.split(":")[0] for n in again) == ["profile of fast", "profile of slow"]
    assert all(": cached (" in n for n in again)

    # no all-reduce timing on the placed actors (measure_allreduce) and no validation: neither
    # is what this run checks (that it plans with the cached profiles and trains)
    drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, small, TWO, tmp_path / "run",
                      val_dataset=val, options=DriverOptions(profile_in_tasks=True,
                                                             profile_cache_dir=str(tmp_path / "prof"),
                                                             measure_allreduce=False, evaluate=False))
    hist = drv.run()
    assert len(hist.epochs) == 1
    assert sum("profile of" in m and "cached" in m for m in hist.events) == 2
    assert drv.planner.model.profiles == profiles


class FreeAfterEpoch(DriverCallback):
    """Removes the placement group ``pg`` (another job's hold on GPUs) after epoch ``epoch``."""

    def __init__(self, pg, epoch: int) -> None:
        self.pg, self.epoch = pg, epoch

    def on_epoch(self, drv, record):
        from ray.util.placement_group import remove_placement_group
        if self.pg is not None and record.epoch == self.epoch:
            remove_placement_group(self.pg)
            self.pg = None


def test_a_placement_not_met_in_time_replans_over_the_free_gpus(cluster, tmp_path):
    """Another job holds both slow GPUs. The run asks for both of its GPUs (one fast, one slow);
    the slow GPU's placement times out (3 s), the driver says so in one event and re-plans over
    what is free (the fast GPU), trains epoch 0 there; the other job lets go after epoch 0, so
    epoch 1's plan (both GPUs, autoscale off) is placed in full. Each epoch served every sample once."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    hold = placement_group([{"gpu_slow": 1.0}] * 2, strategy="STRICT_PACK")
    ray.get(hold.ready(), timeout=60)
    ds, val = tiny_data(240)
    try:
        drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job(2), TWO, tmp_path / "free",
                          val_dataset=val, perf_model=perf_model(SPEEDS),
                          callbacks=[FreeAfterEpoch(hold, epoch=0)],
                          options=DriverOptions(placement_timeout_s=3, record_samples=True,
                                                preflight=True))
        hist = drv.run()
    finally:
        remove_placement_group(hold)
    replans = [m for m in hist.events if "re-planned over the free GPUs" in m]
    assert len(replans) == 1 and "\n" not in replans[0]
    assert "placement timed out after 3s" in replans[0] and "node s" in replans[0]
    assert "{'f': 1}" in replans[0]
    assert [e.allocation for e in hist.epochs] == [{"f": 1}, {"f": 1, "s": 1}]
    assert_each_sample_once_per_epoch(hist, 240)
    assert not [m for m in hist.events if "failure" in m]
    assert sum(m.startswith("pre-flight: 2 GPU node(s) reached the driver's node at ")
               for m in hist.events) == 1


def test_preflight_names_the_gpu_node_and_port_it_cannot_reach(cluster, tmp_path):
    """The GPU nodes of an unpinned spec are the two raylets with emulated GPUs; both connect to
    a listener of the port range. A port nothing listens on: one line naming the first node
    and the address. A range whose only port is taken: one line naming the range, and a driver
    with preflight stops before any GPU actor starts."""
    import ray

    from jabasray.actors.placement import gpu_ray_nodes
    from jabasray.actors.rendezvous import check_reachable, node_ip, preflight
    from jabasray.errors import PreflightFailed

    nodes = gpu_ray_nodes(FOUR, emulate=True)
    assert set(nodes) == {n["NodeID"] for n in ray.nodes() if n["Alive"]
                          and {"gpu_fast", "gpu_slow"} & set(n["Resources"])}
    assert len(nodes) == 2
    ports = free_port_range()
    line = preflight(nodes, ports=ports)
    assert line.startswith(f"pre-flight: 2 GPU node(s) reached the driver's node at {node_ip()}:")
    assert ports[0] <= int(line.split(":")[2].split(" ")[0]) <= ports[1]

    taken = socket.socket()
    taken.bind((node_ip(), 0))
    port = taken.getsockname()[1]
    try:
        with pytest.raises(PreflightFailed) as info:     # bound, not listening: refused
            check_reachable(nodes, node_ip(), port, timeout_s=5)
        msg = str(info.value)
        first = next(iter(nodes))
        assert "\n" not in msg and f"GPU node {nodes[first]} (Ray node {first[:8]})" in msg
        assert f"{node_ip()}:{port}" in msg and "ConnectionRefusedError" in msg
        with pytest.raises(PreflightFailed, match=rf"^pre-flight: could not listen on .* rendezvous_ports \[{port}, {port}\]"):
            preflight(nodes, ports=(port, port))
        ds, _ = tiny_data(240)
        drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job(1), TWO, tmp_path / "pre",
                          perf_model=perf_model(SPEEDS),
                          options=DriverOptions(preflight=True, rendezvous_ports=(port, port)))
        with pytest.raises(PreflightFailed):
            drv.run()
        assert drv.gpu_actors() == []
    finally:
        taken.close()


class Progress(DriverCallback):
    """What a follower of the driver actor saw: epochs, events."""

    def __init__(self) -> None:
        self.epochs, self.events = [], []

    def on_epoch(self, drv, record):
        self.epochs.append(record.epoch)

    def on_event(self, drv, message):
        self.events.append(message)


def actor_node(handle) -> str:
    """The Ray node id an actor runs on."""
    import ray
    return ray.get(handle.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id()),
                   timeout=60)


def test_the_node_hosting_the_driver_actor_dies_and_the_run_finishes(cluster, tmp_path):
    """The driver actor runs on a node of its own (``driver_node``: the module's worker node,
    which the job's GPUs are not on; not the head); in the middle of epoch 1 that node leaves
    the cluster (the module's last test: no test after it needs that node, so none is added
    for it). Its GPU actors die with their owner; Ray restarts
    the driver on another node, which removes the old incarnation's leftovers, resumes from the
    epoch-1 checkpoint and finishes: epoch 0 is kept (not trained again), each epoch served
    every sample exactly once, and nothing of the run is left. Epoch 1 is held open (its reads
    wait once 32 of its rows are read) until the node is gone, so the death lands
    mid-epoch however fast or loaded the machine is."""
    import ray

    from jabasray.actors import run_client
    from jabasray.actors.driver_actor import driver_actor_name, NAMESPACE
    from jabasray.actors.trainer import JabasTrainer
    from jabasray.config import RunConfig

    host = next(iter(cluster.worker_nodes))                        # the slow GPUs' node
    pair = ClusterSpec(nodes=[NodeSpec("f", "fast", 2, speed=1.0)])   # 2 actors (on the head): a short test
    ds, val = tiny_data(240)
    held = HeldRows(ds, tmp_path, after=240 + 32)
    trainer = JabasTrainer(model_fn, held, optimizer_fn, loss_fn, job(2), cluster=pair,
                           run_config=RunConfig(str(tmp_path), "dnode"), val_dataset=val,
                           perf_model=perf_model(SPEEDS),
                           options=DriverOptions(driver="actor", driver_node=host.node_id,
                                                 record_samples=True, failure_grace_s=5))
    assert trainer.fit(wait=False) == "dnode"
    handle = ray.get_actor(driver_actor_name("dnode"), namespace=NAMESPACE)
    assert actor_node(handle) == host.node_id

    held.wait_held()
    cluster.remove_node(host)
    held.release()                                 # the restarted driver reads freely

    seen = Progress()
    result = run_client.follow("dnode", [seen])
    hist = result.history
    assert [e.epoch for e in hist.epochs] == [0, 1]
    restart = [m for m in hist.events if "driver actor restarted" in m]
    assert len(restart) == 1 and "resumed automatically from epoch_0001" in restart[0]
    assert seen.epochs == [1]                      # epoch 0 was kept, epoch 1 redone once
    assert_each_sample_once_per_epoch(hist, 240)
    assert result.run_checkpoint.epochs_done == 2
    t0 = time.monotonic()
    while "dnode" in run_client.running_runs() and time.monotonic() - t0 < 60:
        time.sleep(0.1)
    assert "dnode" not in run_client.running_runs()
    assert not [e for e in ray.util.list_named_actors(all_namespaces=True) if e["namespace"] == NAMESPACE]


# Ray workers cannot import this test module: ship its classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
