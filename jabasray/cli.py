"""The ``jabasray`` command. Each sub-command lives in ``jabasray/commands/<name>.py`` and
provides ``register(subparsers)``, which adds its parser and sets ``func(args) -> int``.

Errors a user can fix (bad files, bad values) are printed as one line, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
import typing

# name -> module under jabasray.commands; modules are imported only when present.
SUBCOMMANDS = ("train", "plan", "profile", "tune", "simulate", "runs")  # runs: status, attach, stop


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``jabasray <command>: error: ...``, exit 2); sub-command
    parsers inherit it. ``--help`` still shows the usage."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="jabasray",
        description="Adaptive batching, auto-scaling and packed training on heterogeneous GPUs (Ray + PyTorch).")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            mod = importlib.import_module(f"jabasray.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"jabasray.commands.{name}":
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from .errors import JobFailed

    try:
        return int(args.func(args) or 0)
    except JobFailed as e:   # not the user's input: exit 1, still one line
        print(f"jabasray {args.command}: failed: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"jabasray {args.command}: error: {e}", file=sys.stderr)
        for note in getattr(e, "__notes__", ()):   # a failing hook: the user's frames only
            print(note, file=sys.stderr)
        return 2
    except OSError as e:   # file-system problems (no permission, disk full ...): one line
        print(f"jabasray {args.command}: error: {os_error_text(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"jabasray {args.command}: interrupted", file=sys.stderr)
        return 130


def os_error_text(e: OSError) -> str:
    """``<path>: <reason>`` of an OSError (no ``[Errno N]`` noise)."""
    reason = e.strerror or str(e)
    return f"{e.filename}: {reason}" if e.filename else reason


if __name__ == "__main__":
    sys.exit(main())
