"""No shared file system: a run on a local storage path whose driver restarts on a node that
does not see that folder refuses in one line - it never starts the run again on that node's
own disk; a background job's state moves between actors on different raylets through Ray's
object store, never through a node's disk.

The cluster (``ray.cluster_utils.Cluster`` plus one raylet started with ``ray start``): the head
(the test process, 2 emulated "fast" GPUs), node A and node B, both offering the custom resource
the driver actor needs (``DriverOptions.driver_resources``), so that a restart lands on one of
them. Node B's raylet runs in its own mount namespace (``unshare --mount``) with a private tmpfs
mounted over the storage folder: B's processes really see an empty folder there, as a node's
private disk would. The driver starts on A, commits epoch 1's checkpoint, then A leaves the
cluster; Ray restarts the driver actor on B, which finds no storage marker and refuses, naming
the node and the epoch Ray's key-value store recorded. The files stay intact where they were
written, and nothing was written on B's private disk.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from actors_helpers import HeldRows, loss_fn, model_fn, optimizer_fn, perf_model, tiny_data
from jabasray.actors import run_client
from jabasray.actors.checkpoint import latest_checkpoint
from jabasray.actors.driver import DriverOptions
from jabasray.actors.trainer import JabasTrainer
from jabasray.config import RunConfig
from jabasray.errors import StorageUnavailable
from jabasray.types import ClusterSpec, NodeSpec
from test_trainer import job

pytestmark = pytest.mark.multinode

# one of the head's GPUs, slowly: the refusal holds for any GPU count, and each GPU actor is a
# Ray worker importing torch
ONE = ClusterSpec(nodes=[NodeSpec("n0", "fast", 1, speed=1.0)])
DRIVER_HOST = "driver_host"


def _can_unshare() -> bool:
    if shutil.which("unshare") is None or shutil.which("ray") is None:
        return False
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                          capture_output=True).returncode == 0


def wait_for(cond, what, timeout=180.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.2)


def alive_nodes() -> dict[str, dict]:
    import ray
    return {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}


@pytest.fixture(scope="module")
def cluster(without_session_ray, tmp_path_factory):
    if not _can_unshare():
        pytest.skip("needs `unshare --mount` (root or CAP_SYS_ADMIN) and the `ray` command")
    ray = without_session_ray
    from ray.cluster_utils import Cluster

    storage = tmp_path_factory.mktemp("storage")
    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, include_dashboard=False, resources={"gpu_fast": 2}))
    node_a = c.add_node(num_cpus=1, resources={DRIVER_HOST: 1})
    # node B: its own mount namespace, a private tmpfs over the storage folder
    cmd = (f"mount -t tmpfs tmpfs {storage} && exec ray start --address={c.address} "
           f"--num-cpus=1 --resources='{{\"{DRIVER_HOST}\": 1}}' --block --disable-usage-stats")
    node_b = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", cmd],
                              start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        ray.init(address=c.address, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        wait_for(lambda: len(alive_nodes()) == 3, "the three nodes")
        ids = {"head": next(i for i, n in alive_nodes().items() if "node:__internal_head__" in n["Resources"]),
               "a": node_a.node_id}
        ids["b"] = next(i for i in alive_nodes() if i not in ids.values())
        yield c, node_a, ids, storage
    finally:
        ray.shutdown()
        os.killpg(node_b.pid, signal.SIGTERM)     # the `ray start` we started, and its raylet
        try:
            node_b.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(node_b.pid, signal.SIGKILL)
            node_b.wait()
        c.shutdown()


def _dead(actor) -> bool:
    """Whether ``actor`` is known dead; a ping still unanswered after 5 s is "not yet" (the
    caller polls again), not an error."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
    try:
        ray.get(actor.ping.remote(), timeout=5)
    except RayActorError:
        return True
    except GetTimeoutError:
        return False
    return False


def _status_or_why(run: str) -> dict:
    """``run_client.status(run)``; where the driver actor is gone, the failure says how it
    ended (Ray's state API: its state and death cause) instead of only that it is gone."""
    try:
        return run_client.status(run)
    except ValueError as e:
        from ray.util.state import list_actors
        from jabasray.actors.driver_actor import driver_actor_name
        gone = list_actors(filters=[("name", "=", driver_actor_name(run))], detail=True)
        pytest.fail(f"{e}; Ray's record of the driver actor: "
                    f"{[(a.state, a.node_id, a.death_cause) for a in gone]}")


def _listing_on(node_id: str, folder: str) -> list[str]:
    """``os.listdir(folder)`` as a process on ``node_id`` sees it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def listdir(p):
        return sorted(os.listdir(p)) if os.path.isdir(p) else None
    return ray.get(listdir.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id, soft=False)).remote(folder))


def test_background_job_state_moves_between_actors_on_different_raylets(cluster, tmp_path):
    """A job on an actor of node A; the scheduler (this process) pulls its state and keeps it
    in its storage; the actor's own scratch copy is deleted and the actor killed; the job resumes
    on an actor of node B (whose mount namespace differs) from the pulled state and ends exactly
    where an uninterrupted run ends."""
    import io

    import ray
    import torch
    from ray import cloudpickle
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import test_background as tb
    from jabasray.actors.background import BackgroundScheduler

    _, _, ids, _ = cluster
    cloudpickle.register_pickle_by_value(tb)

    class Host(tb.Host):
        def where(self):
            return ray.get_runtime_context().get_node_id(), getattr(self, "_bg_scratch_dir", None)

    def host_on(node):
        return ray.remote(num_cpus=0)(Host).options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            ids[node], soft=False)).remote(spare=0.5, memory_mb=500.0)

    on_a, on_b = host_on("a"), host_on("b")
    sched = BackgroundScheduler([on_a], storage=str(tmp_path / "states"))
    steps = 300
    h = sched.submit(tb.job(steps=steps, every=5), job_id="mover")
    while h.progress().step < 10:
        time.sleep(0.02)
    ray.get(on_a.bg_pause.remote("mover"))     # held where it is until its actor dies
    assert sched.checkpoint() == ["mover"]
    pulled = torch.load(tmp_path / "states" / "mover.pt", weights_only=True)["step"]
    node, scratch = ray.get(on_a.where.remote())
    assert node == ids["a"] and 10 <= pulled < steps
    shutil.rmtree(scratch)                     # A's disk copy is gone with A
    ray.kill(on_a)
    wait_for(lambda: _dead(on_a), "the actor on node A to die")
    assert sched.rebalance([on_b]) == ["mover"] and h.actor is on_b
    assert ray.get(on_b.where.remote())[0] == ids["b"]
    assert h.progress().step >= pulled          # from the pulled state, not step 0
    assert h.result(timeout=180).step == steps
    final = torch.load(io.BytesIO(ray.get(on_b.bg_state.remote("mover"))), weights_only=True)
    got = tb.make_model()
    got.load_state_dict(final["model"])
    for p, q in zip(got.parameters(), tb.reference(steps).parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
    ray.kill(on_b)


def test_driver_restarted_where_the_run_folder_is_not_visible_refuses_in_one_line(cluster, tmp_path):
    c, node_a, ids, storage = cluster
    assert _listing_on(ids["a"], str(storage)) == []
    (storage / "seen-by-all-but-b").write_text("x")
    assert _listing_on(ids["a"], str(storage)) == ["seen-by-all-but-b"]
    assert _listing_on(ids["b"], str(storage)) == []          # B's private disk
    (storage / "seen-by-all-but-b").unlink()

    ds, val = tiny_data(200)
    held = HeldRows(ds, tmp_path, after=200 + 40)    # holds the run mid-epoch 1
    tr = JabasTrainer(model_fn, held, optimizer_fn, loss_fn, job(2), cluster=ONE,
                      run_config=RunConfig(str(storage), "r"), val_dataset=val, perf_model=perf_model(),
                      options=DriverOptions(driver="actor", driver_node=ids["a"],
                                            driver_resources={DRIVER_HOST: 1}))
    assert tr.fit(wait=False) == "r"
    held.wait_held()                             # mid-epoch 1: epoch_0001 committed
    assert _status_or_why("r")["incarnation"] == 1
    c.remove_node(node_a)                        # the driver's node leaves; Ray restarts it on B
    held.release()
    with pytest.raises(StorageUnavailable) as e:
        run_client.follow("r")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"run 'r': the driver on node {ids['b'][:12]} ")
    assert (f"does not see the run's storage {storage / 'r'} (its marker .jabasray_storage.json "
            f"is missing; Ray's key-value store records epoch_0001 as committed there)") in msg
    assert msg.endswith("refusing to start from scratch")
    # the files are intact where they were written, and B's private disk got nothing
    assert latest_checkpoint(storage / "r").epochs_done == 1
    assert _listing_on(ids["b"], str(storage)) == []
