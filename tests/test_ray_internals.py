"""The private Ray APIs jabasray uses (jabasray/actors/ray_internals.py), against the installed
Ray, without starting Ray; and that no other module of jabasray uses one.

The first test is the loud one: on a Ray outside the tested range, or one that lacks an
internal, it fails with one line per problem saying what and where. The source scan fails when a
private Ray name (``ray._...``, ``_internal_kv``, a ``_name`` of a Ray module, pyarrow's pickled
arguments) is used outside the two internals modules, or when the profiler imports Ray at all.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from jabasray.actors import ray_internals as ri

ROOT = Path(__file__).parents[1] / "jabasray"
# the only modules that may touch private Ray (and pyarrow) APIs
ALLOWED = {"actors/ray_internals.py", "tuner/tune_internals.py"}


def test_the_installed_ray_is_tested_and_has_every_internal_used():
    found = ri.problems()
    assert not found, "\n".join(found)


@pytest.mark.parametrize("version, ok", [("2.60.0", True), ("2.60.3", True), ("2.61.0", False),
                                         ("2.59.1", False), ("3.0.0", False), ("nightly", False)])
def test_versions_outside_the_tested_range_are_one_line(version, ok):
    msg = ri.version_problem(version)
    assert (msg is None) == ok
    if not ok:
        assert "\n" not in msg and msg.startswith(f"Ray {version} is outside the range ")
        assert "(Ray 2.60)" in msg and "jabasray/actors/ray_internals.py" in msg


def test_a_missing_internal_is_named_and_stops_its_accessor(monkeypatch):
    from ray.experimental import internal_kv

    monkeypatch.delattr(internal_kv, "_internal_kv_del")
    ri._require.cache_clear()
    try:
        assert ri.missing_internals(include_pyarrow=False) == [
            "ray.experimental.internal_kv._internal_kv_del('key', 'del_by_prefix', 'namespace')"]
        msg = ri.problems("2.60.0")
        assert len(msg) == 1 and "lacks internals jabasray uses" in msg[0]
        with pytest.raises(ri.RayInternalsError, match=r"^Ray \S+ lacks ray\.experimental\.internal_kv"
                                                       r"\._internal_kv_del\(.*\), which jabasray uses "):
            ri.kv_delete(b"run/x/", namespace="jabasray", prefix=True)
    finally:
        ri._require.cache_clear()


def test_s3_filesystem_options_are_the_ones_it_was_built_with():
    from pyarrow.fs import S3FileSystem

    fs = S3FileSystem(endpoint_override="127.0.0.1:9000", scheme="http", region="eu-west-3",
                      access_key="ak", secret_key="sk")
    assert ri.s3_filesystem_options(fs) == {"endpoint_override": "127.0.0.1:9000", "scheme": "http",
                                            "region": "eu-west-3", "access_key": "ak",
                                            "secret_key": "sk"}


def test_the_profiler_names_gpu_types_by_rays_rule_without_ray():
    """``accelerator_type_of`` (plain, used by the profiler) gives what Ray's own (private)
    accelerator detection gives for the same device name."""
    from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager

    from jabasray.types import accelerator_type_of

    names = ["NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-16GB", "NVIDIA H100 80GB HBM3", "Tesla T4",
             "NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA GeForce RTX 4090",
             "NVIDIA RTX A6000", "NVIDIA TITAN V", "Quadro RTX 8000", "NVIDIA L40S", "NVIDIA A10G",
             "NVIDIA GH200 480GB", "NVIDIA 4", "NVIDIA"]
    for name in names:
        assert accelerator_type_of(name) == NvidiaGPUAcceleratorManager._gpu_name_to_accelerator_type(name), name


# ---------------------------------------------------------------------- the source scan
def _dotted(node: ast.AST) -> list[str] | None:
    """``a.b.c`` of an attribute chain on a name, as ``["a", "b", "c"]`` (None otherwise)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(source: str) -> list[str]:
    """Private Ray names ``source`` uses (line: what): imports of a private Ray module or name,
    ``internal_kv``, an attribute ``_x`` of ``ray`` or of a name imported from Ray, any
    ``_internal_kv*``, and ``.__reduce__()`` calls (pyarrow's pickled constructor arguments)."""
    tree = ast.parse(source)
    ray_names = {"ray"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "ray":
                    ray_names.add(a.asname or "ray")
                    if any(_private(p) or "internal_kv" in p for p in a.name.split(".")):
                        found.append(f"{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray":
            for a in node.names:
                ray_names.add(a.asname or a.name)
                parts = [*node.module.split("."), a.name]
                if any(_private(p) or "internal_kv" in p for p in parts):
                    found.append(f"{node.lineno}: from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if "_internal_kv" in node.attr:
                found.append(f"{node.lineno}: .{node.attr}")
            elif node.attr == "__reduce__" and isinstance(getattr(node, "ctx", None), ast.Load):
                found.append(f"{node.lineno}: .__reduce__")
            chain = _dotted(node)
            if chain and chain[0] in ray_names and _private(chain[-1]):
                found.append(f"{node.lineno}: {'.'.join(chain)}")
        elif isinstance(node, ast.Name) and "_internal_kv" in node.id:
            found.append(f"{node.lineno}: {node.id}")
    return sorted(set(found))


def test_the_scan_finds_each_kind_of_private_use():
    src = ("import ray\nimport ray._private.state\nfrom ray._raylet import PlacementGroupID\n"
           "from ray.experimental import internal_kv\nfrom ray.util import state as st\n"
           "ray._private.worker\nst._x\nk._internal_kv_put()\nfs.__reduce__()\n"
           "ray.PlacementGroupID\nray.util.get_node_ip_address()\nother._fine\n")
    assert [u.split(":")[0] for u in private_uses(src)] == ["2", "3", "4", "6", "7", "8", "9"]


def test_no_private_ray_api_outside_the_internals_modules():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        offenders += [f"jabasray/{rel}:{u}" for u in private_uses(path.read_text())]
    assert not offenders, ("private Ray APIs outside jabasray/actors/ray_internals.py (move them "
                           "there, with a check): " + "; ".join(offenders))


def test_the_profiler_imports_no_ray():
    offenders = []
    for path in sorted((ROOT / "profiler").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.name}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "ray"]
    assert not offenders, "jabasray/profiler must not import Ray: " + "; ".join(offenders)
