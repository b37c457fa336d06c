"""JSON round-trip for the plain dataclasses that planners, the profiler and the driver exchange.

``JsonMixin`` gives a dataclass ``to_dict``/``from_dict``/``to_json``/``from_json`` and
``save``/``load``. Nested dataclasses, lists, tuples and dicts of them are rebuilt from the
type hints, so ``X.from_json(x.to_json()) == x`` for every dataclass that uses it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T", bound="JsonMixin")

# The process umask, read once (os.umask can only be read by setting it): files written through a
# temporary file get the permissions a plain open() would give them, not mkstemp's 0600.
_UMASK = os.umask(0)
os.umask(_UMASK)


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return value.item()
    return value


def _decode(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _decode(non_none[0], value)
        return value
    if isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields"):  # NamedTuple
        hints = typing.get_type_hints(tp)
        return tp(*(_decode(hints.get(n, Any), v) for n, v in zip(tp._fields, value)))
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = _decode(hints.get(f.name, Any), value[f.name])
        return tp(**kwargs)
    if origin in (list, typing.List):
        (inner,) = args or (Any,)
        return [_decode(inner, v) for v in value]
    if origin in (tuple, typing.Tuple):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v) for v in value)
        if args:
            return tuple(_decode(a, v) for a, v in zip(args, value))
        return tuple(value)
    if origin in (dict, typing.Dict):
        kt, vt = args or (Any, Any)
        return {_decode(kt, k): _decode(vt, v) for k, v in value.items()}
    if tp is int and isinstance(value, str):
        return int(value)
    if tp is float and isinstance(value, (int, float)):
        return float(value)
    return value


class JsonMixin:
    """Mixin for dataclasses: lossless JSON round-trip (see module docstring)."""

    def to_dict(self) -> dict:
        return _encode(self)

    @classmethod
    def from_dict(cls: type[T], data: dict) -> T:
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__} must be given a JSON object, got {type(data).__name__}")
        return _decode(cls, data)

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (temp file + rename) so a crash never leaves a torn file."""
        return atomic_write_text(path, self.to_json(indent=2))

    @classmethod
    def load(cls: type[T], path: str | os.PathLike) -> T:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ValueError(f"cannot read {cls.__name__} file {path}: {e.strerror}") from None
        try:
            return cls.from_json(text)
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            raise ValueError(f"{path} is not a valid {cls.__name__} JSON file: {e}") from None


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` via a temporary file in the same folder and ``os.replace``."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temporary file in the same folder and ``os.replace``
    (readers see the old file or the new one, never a partial one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
