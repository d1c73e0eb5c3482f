"""What the command lines of ``python -m bench`` share: the parser, ``--device``, the output options
(``--out-dir``, ``--no-write``, ``--render``), the command as it was run, and the log."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from .report import DEFAULT_OUT

DEVICE_HELP = "cpu or cuda[:i] (default: cuda when available)"


def parser(command: str, doc: Optional[str]) -> argparse.ArgumentParser:
    """The parser of ``python -m bench [command]``, its docstring as the description."""
    return argparse.ArgumentParser(
        prog=f"python -m bench {command}".strip(), description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_device(ap: argparse.ArgumentParser, default: Optional[str] = None, help: str = DEVICE_HELP) -> None:
    ap.add_argument("--device", default=default, help=help)


def device_of(name: Optional[str]) -> torch.device:
    """``--device``, or cuda when torch sees one and the cpu otherwise; a CUDA device torch does not
    see stops the command, saying so."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return device


def add_output(
    ap: argparse.ArgumentParser,
    render: Optional[str] = None,
    out_help: str = "where the result files go (default: bench_runs/, git-ignored)",
) -> None:
    """``--out-dir`` and ``--no-write``; with ``render`` (its help), ``--render RESULT.json``."""
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help=out_help)
    ap.add_argument("--no-write", action="store_true", help="print only")
    if render is not None:
        ap.add_argument("--render", type=Path, metavar="RESULT.json", help=render)


def out_dir(args: argparse.Namespace) -> Optional[Path]:
    """Where ``report.publish`` writes: ``--out-dir``, or None with ``--no-write``."""
    return None if args.no_write else args.out_dir


def command_line(command: str, argv: Sequence[str]) -> str:
    """The command as a user would type it again (the ``command`` of a result's meta)."""
    return " ".join(["python -m bench", *([command] if command else []), *map(shlex.quote, argv)])


def log(msg: str) -> None:
    """Progress goes to stderr; the table to stdout."""
    print(msg, file=sys.stderr, flush=True)
