"""A fake autoscaling Ray cluster on this machine, isolated from the test process.

Ray's fake multi-node provider under the real autoscaler (v1 monitor): a head of 2 CPUs and no
GPU, started by ``ray start --head --autoscaling-config``; the monitor launches a raylet on this
machine per node it scales up. ``ray.cluster_utils.AutoscalingCluster`` does the same but runs
``ray stop --force`` at start and shutdown (every Ray process of the machine, other users' too)
and its template is not shipped in Ray's wheel, hence this helper.

Isolation, so that a module using it leaves nothing behind for the modules after it:

* **Nothing in the test process.** The test process never connects to this cluster and never
  changes its own environment: the job runs in a child interpreter
  (:func:`run_child`). Connecting from the test process is what broke the suite: a test
  process that once started a local Ray (the session fixture's ``ray.init``) has Ray 2.60's
  token authentication switched on for the rest of its life (``RAY_AUTH_MODE=token`` in its
  environment and in the C++ config, cached at that first start), while a ``ray start``
  cluster started without it does not check tokens: every call from the cluster's nodes to
  the test process's core worker (the owner of the GPU actors) was refused ("Missing
  authorization header"), and the actors on the launched nodes died.
* **One authentication mode for all.** The head, the nodes its monitor launches and the
  child driver share one environment built here: ``RAY_AUTH_MODE=disabled`` (the cluster
  listens on 127.0.0.1 and lives for one module), no ``RAY_ADDRESS``.
* **Own folder, own ports.** A private ``--temp-dir`` (Ray writes its ``ray_current_cluster``
  file there, not in /tmp/ray, so no later ``ray.init()`` finds this cluster) and explicit
  free ports for the GCS, the Ray client server and the dashboard agent (their defaults are
  fixed ports another cluster of the machine may hold).
* **Its processes ended by a marker, never by name.** Every process of the cluster (head
  processes, launched raylets, their workers, the child driver) inherits a unique
  environment variable; :meth:`FakeAutoscalingCluster.stop` kills exactly the processes
  whose environment holds it.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

MARKER = "JABASRAY_TEST_CLUSTER"   # the environment variable every process of the cluster carries


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(gcs_address: str, worker_types: dict, head_cpus: int = 2, idle_timeout_s: float = 6.0) -> dict:
    """The fake multi-node provider's cluster config (the fields Ray's fake_multi_node example
    sets) with ``worker_types`` and a head of ``head_cpus`` CPUs and no GPU."""
    return {
        "cluster_name": "jabasray_test", "max_workers": sum(t["max_workers"] for t in worker_types.values()),
        "upscaling_speed": 1.0, "idle_timeout_minutes": idle_timeout_s / 60.0,
        "head_node_type": "ray.head.default",
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": gcs_address},
        "available_node_types": {**worker_types, "ray.head.default": {
            "resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0}},
        "auth": {}, "docker": {}, "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [], "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": []}


class FakeAutoscalingCluster:
    """Start with :meth:`start`, end with :meth:`stop` (also after a failed start)."""

    def __init__(self, worker_types: dict, head_cpus: int = 2, idle_timeout_s: float = 6.0) -> None:
        self.worker_types, self.head_cpus, self.idle_timeout_s = worker_types, head_cpus, idle_timeout_s
        self.marker = uuid.uuid4().hex
        # short: Ray's socket paths must fit in 107 bytes
        self.temp = tempfile.mkdtemp(prefix="jrp", dir="/tmp")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
        env.update({MARKER: self.marker, "RAY_AUTH_MODE": "disabled", "RAY_FAKE_CLUSTER": "1",
                    "AUTOSCALER_UPDATE_INTERVAL_S": "1", "OMP_NUM_THREADS": "1"})
        self.env = env

    def start(self, timeout_s: float = 120.0) -> None:
        path = Path(self.temp) / "autoscaling.json"
        path.write_text(json.dumps(config(self.address, self.worker_types, self.head_cpus,
                                          self.idle_timeout_s)))
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={self.port}",
               "--node-ip-address=127.0.0.1", f"--num-cpus={self.head_cpus}", "--num-gpus=0",
               f"--temp-dir={self.temp}", f"--autoscaling-config={path}",
               f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
               "--include-dashboard=false", "--disable-usage-stats"]
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if out.returncode != 0:
            raise RuntimeError(f"ray start --head failed ({out.returncode}): {out.stderr[-2000:]}")

    def processes(self) -> list[int]:
        """Ids of this cluster's processes (their environment holds the marker), never this one."""
        needle = f"{MARKER}={self.marker}".encode()
        out = []
        for p in os.listdir("/proc"):
            if not p.isdigit() or int(p) == os.getpid():
                continue
            try:
                with open(f"/proc/{p}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        out.append(int(p))
            except OSError:   # gone, or not ours to read
                continue
        return out

    def stop(self) -> list[int]:
        """Kill every process of the cluster (until none is left, 30 s at most: a raylet may
        start a worker while we kill), remove its folder; returns the ids that were left."""
        deadline = time.monotonic() + 30
        while (left := self.processes()) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        import shutil
        shutil.rmtree(self.temp, ignore_errors=True)
        return left

    def log_digest(self, lines: int = 40) -> str:
        """What to read when a job on the cluster failed: the autoscaler's last lines and the
        warnings and errors of the raylets and workers (the folder is removed by :meth:`stop`)."""
        logs = sorted(Path(self.temp).glob("session_2*/logs"))
        if not logs:
            return "(no Ray logs)"
        out = []
        monitor = logs[-1] / "monitor.log"
        if monitor.exists():
            out += ["monitor.log: " + s for s in monitor.read_text(errors="replace").splitlines()[-lines // 2:]]
        words = ("error", "died", "killed", "authoriz", "exit")
        for f in sorted(logs[-1].glob("raylet*.out")) + sorted(logs[-1].glob("python-core-*.log")):
            hits = [s for s in f.read_text(errors="replace").splitlines()
                    if any(w in s.lower() for w in words) and "state-dump" not in s]
            out += [f"{f.name}: {s}" for s in hits[-5:]]
        return "\n".join(out[-lines * 2:])

    def run_child(self, script: str, args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
        """Run ``script`` (a Python file) in a child interpreter with the cluster's environment
        (its address in ``JABASRAY_TEST_ADDRESS``); its output is returned, never raised on."""
        env = dict(self.env, JABASRAY_TEST_ADDRESS=self.address)
        try:
            return subprocess.run([sys.executable, script, *args], env=env, capture_output=True,
                                  text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            text = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                    for x in (e.stdout, e.stderr)]
            return subprocess.CompletedProcess(e.cmd, -9, text[0],
                                               f"{text[1]}\ntimed out after {timeout_s:.0f} s")
