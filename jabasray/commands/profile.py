"""``jabasray profile``: measure a model on this device and write its Profile JSON.

torch is imported only when the command runs (``jabasray plan`` stays light).
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

from ..validation import check_float, check_int

HELP = """\
Profile a model on this device with the IIDP engine (JABAS section 5.1): compute time at
n_vsw = 1 and n_max for every local batch size (multiples of --min-local-batch up to the largest
that fits), the forward share, optimizer and weight-copy time, gradient bucket sizes and the
all-reduce regression (2-process gloo group on 127.0.0.1). Default model: the digits CNN on the
bundled digits data. --model-script FILE.py: a Python file that defines build_model() -> nn.Module
and dataset() -> a dataset of (input, target) pairs (or sample_batch(n) -> (inputs, targets)).

--emulate TYPE=SPEED (repeatable) writes, instead of one profile, one profile per emulated GPU
type, scaled from the measured one (Profile.scaled), into one file: `jabasray plan` accepts it.
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("profile", help="profile a model on this device",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="where to write the profile JSON")
    p.add_argument("--gpu-type", default=None, help="GPU type name (default: device name, or 'cpu')")
    p.add_argument("--min-local-batch", type=int, default=8)
    p.add_argument("--max-local-batch", type=int, default=None,
                   help="cap on the largest local batch probed (default 8x min on CPU, 32x on CUDA)")
    p.add_argument("--memory-budget-gb", type=float, default=None,
                   help="CPU: memory bound per device used to find max B_L and n_max")
    p.add_argument("--max-num-vsw", type=int, default=4, help="cap on n_max")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per point (median)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads while profiling (default 1: one core per emulated device)")
    p.add_argument("--model-script", default=None, help="Python file with build_model() and dataset()")
    p.add_argument("--no-allreduce", action="store_true", help="skip the gloo all-reduce measurement")
    p.add_argument("--cache-dir", default=None, help="reuse/keep profiles keyed by model and device")
    p.add_argument("--emulate", action="append", default=[], metavar="TYPE=SPEED",
                   help="write scaled profiles for emulated GPU types (repeatable)")
    p.set_defaults(func=run)


def _parse_emulate(items: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        name, sep, speed = item.partition("=")
        if not sep or not name:
            raise ValueError(f"emulate must be TYPE=SPEED, got {item!r}")
        try:
            out[name] = check_float(f"emulate[{name}]", float(speed), min_value=0, min_exclusive=True)
        except ValueError:
            raise ValueError(f"emulate[{name}] must be a number > 0, got {speed!r}") from None
    return out


def _load_script(path: str) -> tuple[Any, Any]:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"model_script {path}: no such file")
    spec = importlib.util.spec_from_file_location("jabasray_user_model", file)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    except Exception as e:  # a user script: report, don't trace
        raise ValueError(f"model_script {path} failed to load: {type(e).__name__}: {e}") from None
    if not callable(getattr(mod, "build_model", None)):
        raise ValueError(f"model_script {path} must define build_model() -> torch.nn.Module")
    if callable(getattr(mod, "sample_batch", None)):
        return mod.build_model, mod.sample_batch
    if callable(getattr(mod, "dataset", None)):
        return mod.build_model, mod.dataset()
    raise ValueError(f"model_script {path} must define dataset() or sample_batch(n)")


def run(args: argparse.Namespace) -> int:
    check_int("min_local_batch", args.min_local_batch, min_value=1)
    check_int("max_num_vsw", args.max_num_vsw, min_value=1)
    check_int("repeats", args.repeats, min_value=1)
    check_int("threads", args.threads, min_value=1)
    emulate = _parse_emulate(args.emulate)
    import torch

    from ..profiler.measure import profile_model
    from ..profiles import save_profiles

    torch.set_num_threads(args.threads)
    if args.model_script:
        build, data = _load_script(args.model_script)
    else:
        from ..data import load_digits_split
        from ..models import DigitsCNN
        build, data = DigitsCNN, load_digits_split()[0]
    prof = profile_model(build, data, device=args.device, gpu_type=args.gpu_type,
                         min_local_batch=args.min_local_batch, max_local_batch=args.max_local_batch,
                         memory_budget_gb=args.memory_budget_gb, max_num_vsw=args.max_num_vsw,
                         repeats=args.repeats, allreduce=not args.no_allreduce,
                         cache_dir=args.cache_dir)
    if emulate:
        profiles = [prof.scaled(s, t) for t, s in emulate.items()]
        save_profiles(profiles, args.out)
        print(f"wrote {len(profiles)} emulated profiles ({', '.join(emulate)}) to {args.out}")
    else:
        prof.save(args.out)
        print(f"wrote profile of {prof.gpu_type} (B_L {prof.local_batches}, "
              f"{len(prof.bucket_sizes)} bucket(s)) to {args.out}")
    return 0
