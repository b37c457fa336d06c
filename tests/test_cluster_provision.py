"""Provisioning through Ray's autoscaler, on a fake autoscaling cluster of this machine: a head
without GPUs started with an autoscaler config of two worker node types (``fast``: 2 emulated
"fast" GPUs, ``slow``: 2 "slow" ones, at most 2 nodes each, idle timeout of seconds), whose
fake node provider starts a raylet per launched node.

``ray.cluster_utils.AutoscalingCluster`` is not used: its start and shutdown run ``ray stop
--force`` (every Ray process of the machine, other users' too) and its template is not shipped
in Ray's wheel; the fixture starts the same head with ``ray start --autoscaling-config`` on its
own port and temp folder, and ends exactly the processes of that cluster, by id.

Proves: a job given only the node types (no GPU node is alive) plans on launchable nodes
(charged their launch time), ``fit``'s request to Ray's autoscaler launches the nodes of the
chosen allocation and the actors train on them; the launched nodes keep their candidates' names,
so a second epoch on the same allocation keeps its actors; after the run the request is cleared
and the autoscaler lets the nodes go (the head alone within its idle timeout).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import shutil
import sys
import tempfile
import time

import pytest

from actors_helpers import loss_fn, model_fn, optimizer_fn, perf_model, tiny_data
from jabasray.actors.driver import DriverOptions, JabasDriver
from jabasray.config import JobConfig
from jabasray.types import ClusterSpec, NodeType

pytestmark = pytest.mark.multinode

SPEEDS = {"fast": 1.0, "slow": 0.5}
WORKER_TYPES = {
    "fast": {"resources": {"CPU": 1, "gpu_fast": 2}, "node_config": {}, "min_workers": 0, "max_workers": 2},
    "slow": {"resources": {"CPU": 1, "gpu_slow": 2}, "node_config": {}, "min_workers": 0, "max_workers": 2},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(gcs_address: str) -> dict:
    """The fake multi-node provider's cluster config (the fields Ray's fake_multi_node example
    sets), with the worker types above and a head of 2 CPUs and no GPU."""
    return {
        "cluster_name": "jabasray_provision", "max_workers": 4, "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1, "head_node_type": "ray.head.default",
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": gcs_address},
        "available_node_types": {**WORKER_TYPES, "ray.head.default": {
            "resources": {"CPU": 2}, "node_config": {}, "max_workers": 0}},
        "auth": {}, "docker": {}, "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [], "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": []}


def _processes_of(markers: list[bytes]) -> list[int]:
    """Ids of the processes whose command line names one of ``markers`` (this cluster's port
    or temp folder), never this process."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if any(m in cmd for m in markers):
            out.append(int(p))
    return out


@pytest.fixture(scope="module")
def autoscaling(without_session_ray, tmp_path_factory):
    ray = without_session_ray
    folder = tmp_path_factory.mktemp("autoscaling")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    config = folder / "config.json"
    config.write_text(json.dumps(_config(address)))
    temp = tempfile.mkdtemp(prefix="jrp", dir="/tmp")   # short: Ray's socket paths must fit 107 bytes
    env = dict(os.environ, RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1",
               RAY_AUTH_MODE="disabled")
    markers = [str(temp).encode(), f":{port}".encode()]
    try:
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", "--head",
                        f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
                        f"--temp-dir={temp}", f"--autoscaling-config={config}",
                        "--include-dashboard=false", "--disable-usage-stats"],
                       env=env, check=True, capture_output=True, timeout=120)
        os.environ["RAY_AUTH_MODE"] = "disabled"
        ray.init(address=address, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        yield ray
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for pid in _processes_of(markers):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp, ignore_errors=True)


def _alive_nodes(ray) -> int:
    return sum(1 for n in ray.nodes() if n["Alive"])


def test_fit_launches_the_chosen_nodes_and_lets_them_go(autoscaling, tmp_path):
    ray = autoscaling
    assert _alive_nodes(ray) == 1
    spec = ClusterSpec(nodes=[], node_types=[
        NodeType("fast", "fast", 2, max_workers=2, speed=SPEEDS["fast"], launch_s=5.0),
        NodeType("slow", "slow", 2, max_workers=2, speed=SPEEDS["slow"], launch_s=5.0)])
    ds, _ = tiny_data(96)
    job = JobConfig(epochs=2, initial_global_batch=16, min_global_batch=8, max_global_batch=32,
                    min_local_batch=4, adapt_interval=2, autoscale=True, seed=1,
                    replacement_cost_s=1e6)          # the second epoch stays where the first ran
    seen = []

    class Watch:
        def on_interval(self, driver, record):
            seen.append(_alive_nodes(ray))
        on_epoch = on_event = lambda *a: None

    drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job, spec, tmp_path / "prov",
                      perf_model=perf_model(SPEEDS), callbacks=[Watch()],
                      options=DriverOptions(placement_timeout_s=120))
    hist = drv.run()
    first = hist.epochs[0].allocation
    assert first and all("+" in name for name in first)      # launchable nodes, chosen at start
    launched = sum(1 for _ in first)
    assert min(seen) >= 1 + launched                          # the chosen nodes ran the epoch
    assert hist.epochs[1].allocation == first and not hist.epochs[1].replaced
    charged = [c for c in hist.epochs[0].decision["candidates"] if c["launch_s"]]
    assert charged and all(c["launch_s"] == 5.0 for c in charged)
    assert drv.view.requested is None                         # the request is cleared ...
    t0 = time.monotonic()
    while _alive_nodes(ray) > 1:                              # ... and the nodes go
        assert time.monotonic() - t0 < 90, f"{_alive_nodes(ray)} nodes alive after the run"
        time.sleep(1)
