"""Shared fixtures. Ray is started at most once per test session (``ray_session``) and shut
down at the end; tests of pure logic never touch it."""
from __future__ import annotations

import os

import pytest
import torch

# Two cores: keep torch from oversubscribing them in the test process. JABASRAY_TEST_THREADS
# runs the suite with more intra-op threads (a test whose outcome changes with the number of
# threads compares at a precision it does not have).
torch.set_num_threads(int(os.environ.get("JABASRAY_TEST_THREADS", "1")))


@pytest.fixture
def float64():
    """Exactness tests run in float64 (``pytestmark = pytest.mark.usefixtures("float64")``).

    Two float32 computations of the same value (a packed update and a plain loop, batched and
    per-worker execution) may differ in the last bits, and by how much depends on the CPU's
    vector width (``ATEN_CPU_CAPABILITY``: default, avx2, avx512 round reductions
    differently) and on the thread count; a float32 tolerance picked on one CPU then fails on
    another. In float64 the same differences are ~1e-16 relative, far below what any real
    mistake (a wrong scale, a missed sample, a stale weight) produces, so the comparison can
    use ``torch.testing.assert_close``'s float64 defaults (rtol 1e-7, atol 1e-7) on every CPU.
    Models, data and optimizer states built inside the test take the default dtype.
    """
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@pytest.fixture(scope="session")
def host_measurements(tmp_path_factory):
    """``seed(folder)``: puts this host's gloo all-reduce fit and compute/communication
    contention (the profiler's host measurements, cached per host and not model-specific:
    :func:`jabasray.profiler.measure.cached_allreduce_fit`,
    :func:`jabasray.profiler.contention.cached_contention`) into a profile cache ``folder``,
    measured once per session. A driver that profiles its model into that folder then measures
    the model only, as on a host that profiled another model before; each host measurement
    otherwise starts gloo child processes (each importing torch) in every test that profiles."""
    import shutil

    from jabasray.profiler.contention import cached_contention
    from jabasray.profiler.measure import cached_allreduce_fit

    measured = tmp_path_factory.mktemp("host_measurements")
    cached_allreduce_fit(measured)
    cached_contention(measured)
    files = sorted(measured.glob("*.json"))
    assert [f.name.split("-")[0] for f in files] == ["allreduce", "contention"]

    def seed(folder):
        os.makedirs(folder, exist_ok=True)
        for f in files:
            shutil.copy(f, os.path.join(str(folder), f.name))
        return folder
    return seed


def _start_session_ray(ray) -> None:
    # address="local": always a new instance, never a `ray start` cluster running on the machine
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             resources={"gpu_fast": 8, "gpu_slow": 8, "gpu_a": 8, "gpu_b": 8},
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance for the whole session, with emulated GPU-type resources.

    Emulated GPU types are custom resources ``gpu_<type>`` (see ``jabasray.actors``); tests
    that need more register them through the cluster spec they use.
    """
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if ray.is_initialized():
        ray.shutdown()
    _start_session_ray(ray)
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    """Modules that start their own Ray (``without_session_ray``: a multi-raylet ``Cluster``, a
    ``ray.init`` of their own) run after all others, in their usual order, so the session's
    local Ray is started once and not stopped and started again around each of them.

    Tests marked ``cuda`` are skipped (reported as skipped, never as passed) without a GPU."""
    items.sort(key=lambda item: "without_session_ray" in item.fixturenames)   # stable sort
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _needs_session_ray(item) -> bool:
    """Whether test ``item`` runs on the session's local Ray: it asks for ``ray_session`` and
    not for ``without_session_ray`` (a module that starts its own Ray may name its own fixture
    ``ray_session``, as tests/test_tuner_ray.py does)."""
    names = item.fixturenames
    return "ray_session" in names and "without_session_ray" not in names


@pytest.fixture(scope="module")
def without_session_ray(request):
    """For a module that starts its own Ray (e.g. a ``ray.cluster_utils.Cluster``): the
    session's local Ray, if running, is shut down before the module, and started again after it
    only when a later test still runs on it (such modules run last: see
    ``pytest_collection_modifyitems``; so in a whole-suite run the session's Ray is never
    started again just for the next such module to shut it down)."""
    ray = pytest.importorskip("ray")
    was_running = ray.is_initialized()
    if was_running:
        ray.shutdown()
    yield ray
    if ray.is_initialized():
        ray.shutdown()
    items = request.session.items
    module_items = [i for i, item in enumerate(items) if item.module is request.module]
    later = items[module_items[-1] + 1:] if module_items else []
    if was_running and any(_needs_session_ray(item) for item in later):
        _start_session_ray(ray)
