"""``python -m bench cpu-floor``: the small CNN's client-batched step on CPU threads, operator by operator,
against the alternatives to the calls it makes.

The layers engine (``sim.batched``) computes C clients' small-CNN gradients with oneDNN's grouped
convolutions in channels-last memory, torch's 2x2 max-pooling and batched matmuls for the head. This
benchmark times, at the engine's shapes (C clients, batch B, 8x8 single-channel inputs), each of those
calls beside other ways to compute the same numbers, interleaved in a rotated order and median taken:

* the second convolution's input gradient: oneDNN's backward against a forward convolution of the
  output gradient with the weights flipped and their channels swapped;
* its weight gradient: oneDNN's backward against a convolution over the batch (the input's channels
  as the batch, the output gradient as the kernel);
* the first convolution (one input channel per client): oneDNN against patches + ``baddbmm`` and
  against nine shifted slices + ``einsum``;
* the pooling, forward and backward: ``max_pool2d`` against a two-stage ``max`` and against
  ``maximum`` with a masked backward;
* the head's three matmuls: ``bmm`` against ``matmul`` and ``einsum``.

Every alternative's result is checked against the same math in float64, within the error bound of
its sum (``k * 2**-24 * sum |a| |b|``, k the terms summed); a row that misses it says so. Then the
whole step: at C=1 (the fixed part) and at C, the per-client rest, and the step time that 8x the
sequential clients' rate (timed in the same run) leaves. docs/client_batched.md reads the table.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from . import cli
from .machine import loadavg, run_meta
from .report import publish
from .timing import median, time_rounds

CB = torch.ops.aten.convolution_backward
CL = torch.channels_last
U32 = 2.0**-24  # float32's unit roundoff


def _conv_bwd(gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, groups: int, mask: List[bool]):
    return CB(gy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], groups, mask)


def _dgrad_weight(w: torch.Tensor, C: int) -> torch.Tensor:
    """The weights of the input gradient as a forward convolution: each client's in/out channels swapped,
    the kernel flipped."""
    o, i = w.shape[0] // C, w.shape[1]
    return w.view(C, o, i, 3, 3).transpose(1, 2).flip(3, 4).reshape(C * i, o, 3, 3)


class FloorCase:
    """One computation: named formulations of it, each a callable returning tensors (``used`` first), and
    the float64 result with its error bound to check them against."""

    def __init__(self, name: str, forms: Dict[str, Callable[[], Tuple[torch.Tensor, ...]]], exact, bound, terms: int):
        self.name, self.forms = name, forms
        self.exact = [t.double() for t in exact]
        self.bound = [terms * U32 * b.double() + 1e-30 for b in bound]

    def error(self, outs: Tuple[torch.Tensor, ...]) -> float:
        """Largest error as a share of its bound (<= 1: within it)."""
        return max(
            float(((o.double() - e).abs() / b).max()) for o, e, b in zip(outs, self.exact, self.bound, strict=True)
        )


def cases(C: int, B: int, seed: int = 0) -> List[FloorCase]:
    """The small CNN's operators at C clients of batch B (8x8 inputs, 8 and 16 channels, 10 classes)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    out: List[FloorCase] = []
    # second convolution: 8 -> 16 channels per client, grouped [B, C*Ch, 8, 8] in channels-last memory
    x = rnd(B, C * 8, 8, 8).contiguous(memory_format=CL)
    w = rnd(C * 16, 8, 3, 3)
    gy = rnd(B, C * 16, 8, 8).contiguous(memory_format=CL)
    wcl = w.contiguous(memory_format=CL)
    x64, w64, gy64 = x.double(), w.double(), gy.double()
    dx64, dw64, _ = _conv_bwd(gy64, x64, w64, C, [True, True, False])
    adx, adw, _ = _conv_bwd(gy64.abs(), x64.abs(), w64.abs(), C, [True, True, False])
    out.append(
        FloorCase(
            "2nd conv input gradient",
            {
                "oneDNN backward (used)": lambda: (_conv_bwd(gy, x, wcl, C, [True, False, False])[0],),
                "forward conv, flipped weights": lambda: (
                    F.conv2d(gy, _dgrad_weight(w, C).contiguous(memory_format=CL), None, 1, 1, 1, C),
                ),
            },
            [dx64],
            [adx],
            16 * 9,
        )
    )

    def wgrad_as_conv():
        xi = x.view(B, C, 8, 8, 8).permute(2, 1, 0, 3, 4).reshape(8, C * B, 8, 8)  # [Cin, C*B, H, W]
        k = gy.view(B, C, 16, 8, 8).permute(1, 2, 0, 3, 4).reshape(C * 16, B, 8, 8)  # kernel: the gradient
        return (F.conv2d(xi, k, None, 1, 1, 1, C).transpose(0, 1),)

    out.append(
        FloorCase(
            "2nd conv weight gradient",
            {
                "oneDNN backward (used)": lambda: (_conv_bwd(gy, x, wcl, C, [False, True, False])[1],),
                "conv over the batch": wgrad_as_conv,
            },
            [dw64],
            [adw],
            B * 64,
        )
    )

    # first convolution: 1 -> 8 channels per client
    x1 = rnd(B, C, 8, 8).contiguous(memory_format=CL)
    w1, b1 = rnd(C * 8, 1, 3, 3), rnd(C * 8)
    w1cl = w1.contiguous(memory_format=CL)

    def conv1_patches():
        cols = F.unfold(x1, 3, padding=1).view(B, C, 9, 64).permute(1, 0, 3, 2).reshape(C, B * 64, 9)
        y = torch.baddbmm(b1.view(C, 1, 8), cols, w1.view(C, 8, 9).transpose(1, 2))  # [C, B*64, 8]
        return (y.view(C, B, 8, 8, 8).permute(1, 2, 3, 0, 4).reshape(B, 8, 8, C * 8).permute(0, 3, 1, 2),)

    def conv1_shifts():
        xp = F.pad(x1.permute(0, 2, 3, 1), (0, 0, 1, 1, 1, 1))  # [B, 10, 10, C]
        cols = torch.stack([xp[:, i : i + 8, j : j + 8] for i in range(3) for j in range(3)], -1)
        y = torch.einsum("bhwck,cok->bhwco", cols, w1.view(C, 8, 9)) + b1.view(C, 8)
        return (y.reshape(B, 8, 8, C * 8).permute(0, 3, 1, 2),)

    out.append(
        FloorCase(
            "1st conv forward",
            {
                "oneDNN grouped (used)": lambda: (F.conv2d(x1, w1cl, b1, 1, 1, 1, C),),
                "patches + baddbmm": conv1_patches,
                "shifted slices + einsum": conv1_shifts,
            },
            [F.conv2d(x1.double(), w1.double(), b1.double(), 1, 1, 1, C)],
            [F.conv2d(x1.double().abs(), w1.double().abs(), b1.double().abs(), 1, 1, 1, C)],
            10,
        )
    )

    # 2x2 max-pooling of the second convolution's output, forward and backward
    xp_ = rnd(B, C * 16, 8, 8).contiguous(memory_format=CL).requires_grad_()
    gp = rnd(B, C * 16, 4, 4).contiguous(memory_format=CL)

    def pool_torch():
        y = F.max_pool2d(xp_, 2)
        return (y.detach(), torch.autograd.grad(y, xp_, gp)[0])

    def pool_two_stage():
        v = xp_.permute(0, 2, 3, 1).view(B, 4, 2, 4, 2, C * 16)
        y = v.max(4)[0].max(2)[0]
        return (y.permute(0, 3, 1, 2).detach(), torch.autograd.grad(y, xp_, gp.permute(0, 2, 3, 1))[0])

    def pool_masked():
        with torch.no_grad():
            v = xp_.detach().permute(0, 2, 3, 1).view(B, 4, 2, 4, 2, C * 16)
            r = torch.maximum(v[:, :, 0], v[:, :, 1])
            y = torch.maximum(r[:, :, :, 0], r[:, :, :, 1])  # [B, 4, 4, N]
            # every maximal element gets the gradient: torch's pooling gives it to the first only
            gx = torch.where(v == y.view(B, 4, 1, 4, 1, -1), gp.permute(0, 2, 3, 1).reshape(B, 4, 1, 4, 1, -1), 0.0)
        return (y.permute(0, 3, 1, 2), gx.view(B, 8, 8, -1).permute(0, 3, 1, 2))

    ref_pool = pool_torch()  # pooling selects, it does not round: float32 max_pool2d is the exact result
    out.append(
        FloorCase(
            "max-pool forward + backward",
            {
                "max_pool2d (used)": pool_torch,
                "two-stage max": pool_two_stage,
                "maximum + masked backward": pool_masked,
            },
            list(ref_pool),
            [t.abs() for t in ref_pool],
            1,
        )
    )

    # the head: Linear(256 -> 10) per client, forward and both gradients
    xh, wh, bh, gh = rnd(C, B, 256), rnd(C, 10, 256), rnd(C, 10), rnd(C, B, 10)

    def head(mm):
        return lambda: (mm(xh, wh.transpose(1, 2)) + bh.unsqueeze(1), mm(gh, wh), mm(gh.transpose(1, 2), xh))

    exact = [t.double() for t in (xh, wh, bh, gh)]
    absd = [t.abs() for t in exact]
    out.append(
        FloorCase(
            "head: 3 batched matmuls",
            {
                "bmm (used)": lambda: (
                    torch.baddbmm(bh.unsqueeze(1), xh, wh.transpose(1, 2)),
                    torch.bmm(gh, wh),
                    torch.bmm(gh.transpose(1, 2), xh),
                ),
                "matmul": head(torch.matmul),
                "einsum": lambda: (
                    torch.einsum("cbi,coi->cbo", xh, wh) + bh.unsqueeze(1),
                    torch.einsum("cbo,coi->cbi", gh, wh),
                    torch.einsum("cbo,cbi->coi", gh, xh),
                ),
            },
            [
                torch.baddbmm(exact[2].unsqueeze(1), exact[0], exact[1].transpose(1, 2)),
                torch.bmm(exact[3], exact[1]),
                torch.bmm(exact[3].transpose(1, 2), exact[0]),
            ],
            [
                torch.baddbmm(absd[2].unsqueeze(1), absd[0], absd[1].transpose(1, 2)),
                torch.bmm(absd[3], absd[1]),
                torch.bmm(absd[3].transpose(1, 2), absd[0]),
            ],
            max(257, B),
        )
    )
    return out


def time_cases(cs: List[FloorCase], reps: int) -> List[Dict[str, Any]]:
    """Every formulation of every case, ``reps`` rounds of one call each in a rotated order
    (``timing.time_rounds``); medians in us."""
    fns = {f"{c.name}: {name}": f for c in cs for name, f in c.forms.items()}
    for f in fns.values():  # warm-up: first calls allocate and pick kernels
        f()
    timed = time_rounds(fns, torch.device("cpu"), reps)
    rows = []
    for c in cs:
        for name, f in c.forms.items():
            res = timed[f"{c.name}: {name}"]
            if res.error is not None:
                raise RuntimeError(f"{c.name}, {name}: {res.error}")
            rows.append(
                {"case": c.name, "formulation": name, "median_us": median(res.times) * 1e6, "error_share": c.error(f())}
            )
    return rows


def _backward_dgrad_as_conv(ctx, gy):
    """``_GroupedConvNHWC.backward`` with the input gradient as a forward convolution (3x3, stride 1,
    padding 1, as in the small CNN), the weight gradient from oneDNN alone: the first row of the table
    swapped into the step."""
    xg, wg = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.conv
    gy = gy.contiguous(memory_format=CL)
    gx = gw = gb = None
    if ctx.needs_input_grad[0]:
        gx = F.conv2d(gy, _dgrad_weight(wg, groups).contiguous(memory_format=CL), None, 1, 1, 1, groups)
    if ctx.needs_input_grad[1]:
        gw = CB(gy, xg, wg, None, stride, padding, dilation, False, [0, 0], groups, [False, True, False])[1]
        gw = gw.contiguous().view(ctx.w_shape)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        gb = gy.sum((0, 2, 3)).view(ctx.w_shape[0], -1)
    return gx, gw, gb, None, None, None, None, None


def _swapped(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` run with ``_backward_dgrad_as_conv`` in place of the grouped convolution's backward."""
    from fedopt_kernels.sim.batched import layers

    def run() -> None:
        cls = layers._GroupedConvNHWC
        keep = cls.__dict__["backward"]
        cls.backward = staticmethod(_backward_dgrad_as_conv)  # type: ignore[method-assign]
        try:
            fn()
        finally:
            cls.backward = keep  # type: ignore[method-assign]

    return run


def time_steps(clients: int, batch: int, rounds: int) -> Dict[str, Dict[str, float]]:
    """Round by round, interleaved (``bench.clients.workload``'s workload and rounds): the client-batched
    step (gradients + fused FedNAR) at C=1 and at C=clients, the latter also with the input gradient as a forward
    convolution, and the sequential clients. Per mode: best and median ms per step, client-steps/s."""
    from fedopt_kernels import FedNAR
    from fedopt_kernels.sim.batched.layers_engine import LayersLoss

    from .clients.settings import HP, SETTINGS
    from .clients.workload import Workload, fused_round, fused_trainer, sequential_round

    s = SETTINGS["small-cnn"]
    runs: Dict[str, Tuple[Callable[[], None], int]] = {}
    for C in sorted({1, clients}):
        wl = Workload(s, C, s.steps, batch, torch.device("cpu"))
        tr = fused_trainer(wl, LayersLoss(wl.model), None)
        runs[f"batched C={C}"] = (functools.partial(fused_round, wl, tr), C)
    runs[f"batched C={clients}, input gradient as a forward conv"] = (
        _swapped(runs[f"batched C={clients}"][0]),
        clients,
    )
    seq = Workload(s, clients, s.steps, batch, torch.device("cpu"))
    hp: Dict[str, Any] = dict(HP)
    runs["sequential"] = (functools.partial(sequential_round, seq, FedNAR(seq.model.parameters(), **hp)), clients)
    for fn, _ in runs.values():
        fn()
    timed = time_rounds({name: fn for name, (fn, _) in runs.items()}, torch.device("cpu"), rounds)
    out = {}
    for name, (_, C) in runs.items():
        res = timed[name]
        if res.error is not None:
            raise RuntimeError(f"{name}: {res.error}")
        best, med = min(res.times) / s.steps, median(res.times) / s.steps  # a round is s.steps steps
        out[name] = {"best_ms": best * 1e3, "median_ms": med * 1e3, "client_steps_per_s": C / med}
    return out


def markdown(result: Dict[str, Any]) -> str:
    m = result["meta"]
    lines = [
        f"# The small CNN's client-batched step on the CPU, operator by operator — {m['device_name']} ({m['date']})",
        "",
        f"- command: `{m['command']}`",
        f"- commit: `{m['commit']}`{' (tracked files changed)' if m.get('dirty') else ''}; torch {m['torch']}; "
        f"threads {m['threads']}; load average before/after {m.get('load_before')} / {m.get('load_after')}",
        f"- C={m['clients']} clients, batch {m['batch']}; medians of {m['reps']} interleaved calls; error: the "
        "largest deviation from float64 as a share of the sum's bound k 2^-24 sum|a||b| (<= 1 passes)",
        "",
        "| computation | formulation | median | vs used | error / bound |",
        "|---|---|---|---|---|",
    ]
    used: Dict[str, float] = {}
    for r in result["rows"]:
        used.setdefault(r["case"], r["median_us"])
        ok = "" if r["error_share"] <= 1 else " **over**"
        lines.append(
            f"| {r['case']} | {r['formulation']} | {r['median_us']:,.0f} us | "
            f"{r['median_us'] / used[r['case']]:.2f}x | {r['error_share']:.3f}{ok} |"
        )
    # "stacked C=": the modes' earlier name, in results saved before the rename
    st = {k.replace("stacked C=", "batched C=", 1): v for k, v in (result.get("steps") or {}).items()}
    if st:
        C = m["clients"]
        seq = st["sequential"]["client_steps_per_s"]
        one, full = st["batched C=1"]["median_ms"], st[f"batched C={C}"]["median_ms"]
        lines += [
            "",
            f"## The whole step (gradients + fused FedNAR), {m['rounds']} interleaved rounds",
            "",
            "A step is one local step of every client: all C at once (client-batched) or one after another "
            "(sequential).",
            "",
            "| mode | best ms per step | median ms per step | client-steps/s (median) | vs sequential |",
            "|---|---|---|---|---|",
        ]
        for name, r in st.items():
            lines.append(
                f"| {name} | {r['best_ms']:.3f} | {r['median_ms']:.3f} | {r['client_steps_per_s']:,.0f} | "
                f"{r['client_steps_per_s'] / seq:.2f}x |"
            )
        lines += [
            "",
            f"Each client past the first adds {(full - one) / max(1, C - 1) * 1e3:.0f} us to the step (medians); "
            f"8x the sequential rate leaves {C / (8 * seq) * 1e3:.3f} ms per step of C={C}.",
        ]
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = cli.parser("cpu-floor", __doc__)
    ap.add_argument("--clients", type=int, default=50, help="C (default 50)")
    ap.add_argument("--batch", type=int, default=10, help="batch per client (default 10)")
    ap.add_argument("--reps", type=int, default=60, help="interleaved calls per formulation (default 60)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds of each step mode (default 15)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, the simulator's)")
    ap.add_argument("--no-steps", action="store_true", help="the operators only")
    cli.add_output(ap)
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    from fedopt_kernels.sim.batched.host_memory import keep_freed_memory

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the simulator's client-batched path and the clients benchmark do
    meta = run_meta(torch.device("cpu"), cli.command_line("cpu-floor", sys.argv[2:] if argv is None else argv))
    meta.update(
        clients=args.clients,
        batch=args.batch,
        reps=args.reps,
        rounds=args.rounds,
        load_before=loadavg(),
    )
    rows = time_cases(cases(args.clients, args.batch), args.reps)
    steps = None if args.no_steps else time_steps(args.clients, args.batch, args.rounds)
    meta["load_after"] = loadavg()
    result = {"meta": meta, "rows": rows, "steps": steps}
    publish(result, cli.out_dir(args), f"cpu-floor-{meta['device_slug']}-{meta['date']}", markdown)
    return 0 if all(r["error_share"] <= 1 for r in rows) else 1
