"""Helpers shared by the benchmark scripts (each run as ``python benchmarks/<name>.py``, which puts
this folder on ``sys.path``)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from jabasray.serialization import atomic_write_text


def write_json(path: str | os.PathLike, doc: Any, *, indent: int = 2, announce: bool = True) -> Path:
    """Write ``doc`` as JSON to ``path`` (folders created, atomic replace); print ``wrote <path>``
    unless ``announce`` is False. Returns the path written."""
    written = atomic_write_text(path, json.dumps(doc, indent=indent))
    if announce:
        print(f"wrote {path}")
    return written
