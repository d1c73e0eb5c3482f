"""``python -m bench calls``: what a reader follows through one ``step()``: the files and functions it runs.

Every Python function call of one step is recorded (``sys.setprofile``) on a 2-tensor model with
the ``reference`` backend, for each algorithm of the catalogue (its first option set: the paper
configuration; ``--option full`` for the one that exercises every role) and its client-batched
form, beside ``torch.optim.SGD``'s step: the **first** step of a new optimizer (its plan is
built), in a fresh process (each optimizer in its own: the package's one-time loading of its
backends counts, as a user's first step pays it), and a **cached** step (the plan reused). A file
is a source file of the optimizer's own package with a called function in it (``fedopt_kernels/``;
for torch's SGD, ``torch/optim/``); a function is one code object there. What they call of torch
or Python is not counted. The counts say how far a reader goes from the class to the math; they
are not timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from . import cli

SHAPES = [(4, 3), (4,)]  # the 2-tensor model: a weight and a bias
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: bench/ is imported from it


@dataclass(frozen=True)
class Calls:
    """The files and functions one call ran (``record``)."""

    files: Tuple[str, ...]
    functions: Tuple[Tuple[str, str], ...]  # (file, qualified name)

    def short_files(self) -> List[str]:
        return [_short(f) for f in self.files]


def _short(path: str) -> str:
    """A path from the package or library root a reader knows it by (``fedopt_kernels/core/plan.py``)."""
    for root in ("fedopt_kernels", "torch", "bench"):
        marker = os.sep + root + os.sep
        i = path.rfind(marker)
        if i >= 0:
            return path[i + 1 :]
    return path


def package_dir(module: Any) -> str:
    """The folder of ``module``'s package (``fedopt_kernels/``, ``torch/optim/``), with a trailing separator."""
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


def record(run: Callable[[], Any], root: str) -> Calls:
    """The Python files under folder ``root`` and their functions that ``run()`` called."""
    files: Set[str] = set()
    functions: Set[Tuple[str, str]] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            name = code.co_filename
            if name.startswith(root):
                files.add(name)
                functions.add((name, getattr(code, "co_qualname", code.co_name)))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return Calls(tuple(sorted(files)), tuple(sorted(functions)))


def _params(batched: bool) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    shapes = [((3, *s) if batched else s) for s in SHAPES]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


def optimizer_steps(algo: str, option: Optional[str] = None, batched: bool = False) -> Tuple[Calls, Calls]:
    """(first step, cached step) of catalogue algorithm ``algo``'s option set ``option`` (default: its
    first) on the reference backend: the first step of a new optimizer builds the plan, the next
    reuses it. In this process: what the package loads once (its backends) counts only if nothing
    stepped before."""
    import fedopt_kernels
    from fedopt_kernels.fl import algorithm, catalogue

    root = package_dir(fedopt_kernels)

    entry = catalogue.ALGOS[algo]
    cfg = entry.options[option or next(iter(entry.options))]
    params = _params(batched)
    opt: Any = (cfg.build_batched if batched else cfg.build)(params, "reference")
    order = [p for group in opt.param_groups for p in group["params"]]
    if batched:
        clients = [[p[c] for p in order] for c in range(order[0].shape[0])]
        opt.start_round(**cfg.batched_round_inputs(clients, order, 0))
        inputs = cfg.batched_step_inputs(clients, 0, stacked=order)
    else:
        opt.start_round(**cfg.round_inputs(order, 0))
        inputs = cfg.step_inputs(order, 0)
    if algorithm.of_optimizer(cfg.cls).closure_step:
        closure = inputs.pop("closure")
        first = record(lambda: opt.step(closure, **inputs), root)
        return first, record(lambda: opt.step(closure, **inputs), root)
    first = record(lambda: opt.step(**inputs), root)
    return first, record(lambda: opt.step(**inputs), root)


def torch_sgd_steps() -> Tuple[Calls, Calls]:
    """(first step, later step) of ``torch.optim.SGD(momentum=0.9)`` on the same model, for scale."""
    params = _params(False)
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    root = package_dir(torch.optim)
    return record(lambda: opt.step(), root), record(lambda: opt.step(), root)


def _fresh(algo: str, option: Optional[str], batched: bool) -> Calls:
    """The first step of ``algo``'s optimizer in a new process (``optimizer_steps`` there)."""
    code = (
        "import json, sys; from bench import calls; "
        f"first, _ = calls.optimizer_steps({algo!r}, {option!r}, {batched!r}); "
        "json.dump([first.files, first.functions], sys.stdout)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    files, functions = json.loads(out.stdout)
    return Calls(tuple(files), tuple(tuple(f) for f in functions))


def table(algos: Sequence[str], full: bool, batched: bool) -> List[Dict[str, Any]]:
    """One row per optimizer: its first step (in a fresh process) and a cached step."""
    from fedopt_kernels.fl import catalogue

    rows = []
    first, cached = torch_sgd_steps()
    rows.append(dict(name="torch.optim.SGD", first=first, cached=cached))
    for algo in algos:
        entry = catalogue.ALGOS[algo]
        option = entry.full if full else None
        for b in (False, True) if batched else (False,):
            _, cached = optimizer_steps(algo, option, b)
            name = ("Batched" if b else "") + entry.cls.__name__
            rows.append(dict(name=name, first=_fresh(algo, option, b), cached=cached))
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = cli.parser("calls", __doc__)
    ap.add_argument("--algos", nargs="+", help="the catalogue's names (default: every algorithm)")
    ap.add_argument("--full", action="store_true", help="each algorithm's option set with every role")
    ap.add_argument("--no-batched", action="store_true", help="leave out the client-batched forms")
    ap.add_argument("--files", action="store_true", help="list the files of each step")
    args = ap.parse_args(argv)
    from fedopt_kernels.fl import catalogue

    algos = args.algos or list(catalogue.ALGOS)
    unknown = [a for a in algos if a not in catalogue.ALGOS]
    if unknown:
        ap.error(f"--algos: {unknown} not in the catalogue {list(catalogue.ALGOS)}")
    rows = table(algos, args.full, not args.no_batched)
    print(f"one step on the reference backend, 2 tensors {SHAPES}; torch {torch.__version__}")
    print("files and functions of the optimizer's own package (fedopt_kernels/; torch's: torch/optim/)")
    print(f"{'optimizer':20s} {'cached: files':>13s} {'functions':>9s} {'first: files':>13s} {'functions':>9s}")
    for r in rows:
        c, f = r["cached"], r["first"]
        print(f"{r['name']:20s} {len(c.files):13d} {len(c.functions):9d} {len(f.files):13d} {len(f.functions):9d}")
        if args.files:
            print("    cached: " + ", ".join(c.short_files()))
            print("    first:  " + ", ".join(f.short_files()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
