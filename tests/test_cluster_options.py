"""The cluster-facing driver options without Ray: actor environment and rendezvous-port checks,
their CLI flags, the interval deadline, the loader CPUs of a bundle, the rendezvous store on the
first free port of a range, and a rendezvous nobody answers as RendezvousFailed (one line)."""
from __future__ import annotations

import socket

import pytest

from jabasray.actors.driver import DriverOptions, interval_deadline, loader_cpus
from jabasray.actors.hooks import JobHooks
from jabasray.actors.placement import bundle_for
from jabasray.actors.rendezvous import Rendezvous, join_process_group, listen_socket
from jabasray.commands.train import parse_actor_env, parse_port_range
from jabasray.errors import RendezvousFailed
from jabasray.types import ClusterSpec, NodeSpec


@pytest.mark.parametrize("env, field", [
    ({"NCCL_DEBUG": "LOUD"}, "NCCL_DEBUG"), ({"GLOO_SOCKET_IFNAME": " "}, "GLOO_SOCKET_IFNAME"),
    ({"1BAD": "x"}, "'1BAD'"), ({"NCCL_SOCKET_IFNAME": 3}, "NCCL_SOCKET_IFNAME"),
    (["NCCL_DEBUG=INFO"], "actor_env")])
def test_actor_env_is_checked_in_one_line(env, field):
    with pytest.raises(ValueError) as info:
        DriverOptions(actor_env=env)
    assert field in str(info.value) and "\n" not in str(info.value)


def test_actor_env_and_ports_round_trip_and_bad_ports_are_refused():
    opts = DriverOptions(actor_env={"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0"},
                         rendezvous_ports=[29400, 29410])
    assert opts.rendezvous_ports == (29400, 29410)
    assert DriverOptions.from_dict(opts.to_dict()) == opts
    for bad in [(29410, 29400), (80, 90), (29400,), ("a", "b"), (29400, 70000)]:
        with pytest.raises(ValueError, match="rendezvous_ports"):
            DriverOptions(rendezvous_ports=bad)
    with pytest.raises(ValueError, match="call_timeout_s"):
        DriverOptions(call_timeout_s=0)


def test_cli_flags_parse_to_the_options():
    assert parse_actor_env(["NCCL_DEBUG=WARN", "X=a=b"]) == {"NCCL_DEBUG": "WARN", "X": "a=b"}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_actor_env(["NCCL_DEBUG"])
    assert parse_port_range("29400-29410") == (29400, 29410) and parse_port_range("29400") == (29400, 29400)
    assert parse_port_range(None) is None
    with pytest.raises(ValueError, match="FIRST-LAST"):
        parse_port_range("x-y")


def test_interval_deadline_and_loader_cpus():
    opts = DriverOptions(call_timeout_s=60, interval_timeout_factor=10)
    assert interval_deadline(opts, 1.0) == 60 and interval_deadline(opts, 30.0) == 300
    assert loader_cpus(None) == 0 and loader_cpus(JobHooks(num_data_workers=3)) == 3
    assert bundle_for("fast", True, {"gpu_fast": 2}, cpus=3) == {"gpu_fast": 1.0, "CPU": 3.0}
    assert bundle_for("v100", False, {"GPU": 8}, cpus=2) == {"GPU": 1.0, "CPU": 2.0}
    assert bundle_for("fast", True, {"CPU": 2}, cpus=1) == {"CPU": 1.01}


def test_the_store_listens_on_the_first_free_port_of_the_range():
    blocker = listen_socket("127.0.0.1")
    taken = blocker.getsockname()[1]
    try:
        if taken + 1 > 65535:
            pytest.skip("kernel gave the last port")
        sock = listen_socket("127.0.0.1", (taken, taken + 1))
        try:
            assert sock.getsockname()[1] == taken + 1
        finally:
            sock.close()
        with pytest.raises(RuntimeError, match="rendezvous_ports"):
            listen_socket("127.0.0.1", (taken, taken))
    finally:
        blocker.close()


def test_a_rendezvous_nobody_answers_is_rendezvous_failed():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                         # nobody listens there now
    rdv = Rendezvous("127.0.0.1", port, world_size=2, timeout_s=2, secret="ab")
    with pytest.raises(RendezvousFailed) as info:
        join_process_group(rdv, 1)
    msg = str(info.value)
    assert "\n" not in msg and f"127.0.0.1:{port}" in msg and msg.startswith("rank 1:")


def test_profile_type_names_match_ray_detection():
    """``jabasray profile`` names a CUDA device's type as ClusterSpec.from_ray names a node of
    that GPU (Ray's accelerator type, lower-cased)."""
    from jabasray.profiler.measure import gpu_type_name
    from jabasray.types import ClusterSpec
    for device_name, accel in [("NVIDIA A100-SXM4-80GB", "A100"), ("Tesla V100-SXM2-16GB", "V100"),
                               ("NVIDIA H100 80GB HBM3", "H100")]:
        node = {"NodeID": "ab" * 14, "Alive": True,
                "Resources": {"GPU": 2.0, f"accelerator_type:{accel}": 1.0}}
        assert gpu_type_name(device_name) == ClusterSpec.from_ray([node]).nodes[0].gpu_type


def test_train_profiles_flag_reads_a_folder_of_profiles(tmp_path):
    from jabasray.commands.train import profiles_from
    from jabasray.profiles import save_profiles, synthetic_profile
    save_profiles([synthetic_profile("a100")], tmp_path / "a.json")
    synthetic_profile("v100").save(tmp_path / "v.json")
    got = profiles_from(str(tmp_path))
    assert sorted(got) == ["a100", "v100"] and got["v100"].gpu_type == "v100"
    assert sorted(profiles_from(str(tmp_path / "a.json"))) == ["a100"]
    assert profiles_from(None) is None
    with pytest.raises(ValueError, match="profiles"):
        profiles_from(str(tmp_path / "none"))


def test_shared_node_devices_pick_the_gpu_ray_assigned():
    """With the node's GPUs shared (Ray leaves CUDA_VISIBLE_DEVICES alone) the actor's device is
    the index of its Ray-assigned GPU among those visible; Ray's default (its own GPU only) is
    cuda:0."""
    from jabasray.actors.gpu_actor import SHARE_DEVICES_ENV, cuda_device, visible_index
    assert visible_index("3", None) == 3 and visible_index("3", "") == 3
    assert visible_index("3", "2,3,5") == 1 and visible_index("5", " 2, 3 ,5") == 2
    with pytest.raises(ValueError, match="not in CUDA_VISIBLE_DEVICES"):
        visible_index("4", "2,3")
    assert cuda_device({}) == "cuda:0" and cuda_device({SHARE_DEVICES_ENV: "0"}) == "cuda:0"
    assert DriverOptions(device="cuda", share_node_devices=True).share_node_devices is True
    with pytest.raises(ValueError, match="share_node_devices"):
        DriverOptions(share_node_devices="yes")


def test_an_unfittable_contention_measurement_plans_like_none():
    """A profile whose contention measurement shows no bandwidth (noise on a loaded host) plans
    as the same profile without one, instead of failing every plan."""
    from dataclasses import replace

    from jabasray.planners.perf_model import PerfModel
    from jabasray.profiles import ContentionMeasurement, synthetic_profile
    base = synthetic_profile("g")
    flat = ContentionMeasurement(num_workers=2, sizes=[262144.0, 1048576.0, 4194304.0],
                                 comm_alone=[0.1, 0.1, 0.1], comm_overlapped=[0.1, 0.1, 0.1],
                                 compute_alone=0.02, compute_overlapped=0.02, threads=1)
    noisy = PerfModel({"g": replace(base, contention=flat)})
    clean = PerfModel({"g": base})
    assert noisy.overlap_slowdowns("g") is None
    assert noisy.breakdown("g", base.local_batches[0], 1, 0) == clean.breakdown("g", base.local_batches[0], 1, 0)


def test_free_cluster_counts_the_bundles_each_node_can_hold_now():
    """Exact bookkeeping of :func:`free_cluster`: pinned nodes read their own Ray node, unpinned
    ones the best Ray node of their bundle (which then shrinks); loader CPUs bound the count;
    a node with nothing free is left out, an empty result is None."""
    from jabasray.actors.placement import free_cluster, gpus_offered

    assert gpus_offered({"gpu_a": 3.0, "CPU": 1.0}, {"gpu_a": 1.0, "CPU": 0.5}) == 2
    assert gpus_offered({"gpu_a": 0.999999999999}, {"gpu_a": 1.0}) == 1   # float noise
    pinned = ClusterSpec(nodes=[NodeSpec("a", "a", 4, ray_node_id="r1"), NodeSpec("b", "b", 2, ray_node_id="r2")])
    free = {"r1": {"gpu_a": 3.0, "CPU": 8.0}, "r2": {"gpu_b": 0.0, "CPU": 8.0}}
    got = free_cluster(pinned, free, emulate=True, totals={"gpu_a": 4, "gpu_b": 2})
    assert [(n.name, n.num_gpus, n.ray_node_id) for n in got.nodes] == [("a", 3, "r1")]
    got = free_cluster(pinned, free, emulate=True, cpus=4.0, totals={"gpu_a": 4, "gpu_b": 2})
    assert [(n.name, n.num_gpus) for n in got.nodes] == [("a", 2)]     # 8 CPUs / 4 per GPU
    assert free_cluster(pinned, {"r2": {"gpu_b": 2.0}, "gone": {"gpu_a": 4.0}}, emulate=True,
                        totals={"gpu_a": 4, "gpu_b": 2}).nodes == [NodeSpec("b", "b", 2, ray_node_id="r2")]
    # unpinned: two spec nodes of one type share the Ray nodes' offers, best node first
    spec = ClusterSpec(nodes=[NodeSpec("x", "a", 2), NodeSpec("y", "a", 2), NodeSpec("z", "a", 2)])
    got = free_cluster(spec, {"r1": {"gpu_a": 1.0}, "r2": {"gpu_a": 3.0}}, emulate=True,
                       totals={"gpu_a": 4})
    assert [(n.name, n.num_gpus) for n in got.nodes] == [("x", 2), ("y", 1), ("z", 1)]
    # real GPUs: {"GPU": 1} (no gpu_<type> resource in the cluster)
    got = free_cluster(ClusterSpec(nodes=[NodeSpec("g", "h100", 8, ray_node_id="r")]),
                       {"r": {"GPU": 5.0}}, emulate=False, totals={"GPU": 8})
    assert got.nodes[0].num_gpus == 5
    assert free_cluster(pinned, {}, emulate=True) is None


@pytest.mark.parametrize("found", ["none", "address_file", "env"])
def test_ensure_ray_joins_a_ray_start_cluster_and_else_starts_its_own(monkeypatch, tmp_path, found):
    """With no address given, ``ensure_ray`` joins the cluster ``RAY_ADDRESS`` names or whose
    address a `ray start` wrote where Ray keeps it (Ray's temp folder follows RAY_TMPDIR and
    TMPDIR: a fixed /tmp/ray path misses it), and otherwise starts a local instance with the
    cluster's resources - without asking Ray to look for "any" Ray process on the machine
    (``address="auto"`` alone joins another user's local instance)."""
    import ray

    from jabasray.actors import trainer
    from jabasray.actors.ray_internals import ray_address_file

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address_file().startswith(str(tmp_path))
    if found == "address_file":
        (tmp_path / "ray").mkdir()
        (tmp_path / "ray" / "ray_current_cluster").write_text("10.0.0.2:6379")
    elif found == "env":
        monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    cluster = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2, speed=1.0)])
    started = trainer.ensure_ray(cluster, num_cpus=3)
    want = {"none": "local", "address_file": "auto", "env": "10.0.0.1:6379"}[found]
    assert started is (found == "none") and [c["address"] for c in calls] == [want]
    if found == "none":
        assert calls[0]["num_cpus"] == 3 and calls[0]["resources"] == {"gpu_fast": 2}
    calls.clear()
    assert trainer.ensure_ray(cluster, address="local") is True and [c["address"] for c in calls] == ["local"]
