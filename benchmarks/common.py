"""Helpers shared by the benchmark scripts (each run as ``python benchmarks/<name>.py``, which puts
this folder on ``sys.path``)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from jabasray.serialization import atomic_write_text


def default_out(name: str) -> str:
    """Where a benchmark writes its JSON unless ``--out`` says otherwise: outside the repository,
    in ``$JABASRAY_BENCH_OUT`` or else ``<temp dir>/jabasray_bench``. The figures a run produced go
    to benchmarks/RESULTS.md by hand, with the machine they ran on."""
    root = os.environ.get("JABASRAY_BENCH_OUT") or os.path.join(tempfile.gettempdir(), "jabasray_bench")
    return os.path.join(root, name)


def write_json(path: str | os.PathLike, doc: Any, *, indent: int = 2, announce: bool = True) -> Path:
    """Write ``doc`` as JSON to ``path`` (folders created, atomic replace); print ``wrote <path>``
    unless ``announce`` is False. Returns the path written."""
    written = atomic_write_text(path, json.dumps(doc, indent=indent))
    if announce:
        print(f"wrote {path}")
    return written


def rotated(items: list, k: int) -> list:
    """``items`` rotated left by ``k`` (round k's order: paired rounds rotate the contenders)."""
    k %= len(items)
    return items[k:] + items[:k]


def positive_ints(parser: Any, flag: str, text: str) -> list[int]:
    """``"16,32,64"`` -> ``[16, 32, 64]``; anything else is a CLI error (exit 2) naming ``flag``."""
    try:
        values = [int(v) for v in text.split(",")]
        if not values or min(values) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"{flag} must be comma-separated positive ints, got {text!r}")
    return values
