"""The rows of the training-loop benchmarks (``python -m bench loop`` and ``profile``): the models, each
optimizer doing the same work, and a row's iteration (``zero_grad(set_to_none=True)``, forward,
cross-entropy, backward, ``step()``), eager or replayed as one CUDA graph holding it whole."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch import nn

import fedopt_kernels as fk
from fedopt_kernels.sim.models.resnet_gn import ResNet18GN
from fedopt_kernels.sim.models.small import SmallCNN

MODELS: Dict[str, Callable[[], tuple]] = {
    # name -> (model, input shape per sample, classes)
    "small_cnn": lambda: (SmallCNN((1, 8, 8), 10), (1, 8, 8), 10),
    "resnet18": lambda: (ResNet18GN(3, 10), (3, 32, 32), 10),
}
BATCH = 32
SGD: Dict[str, Any] = dict(lr=0.05, momentum=0.9, weight_decay=5e-4)
BASELINE = "torch.SGD(fused)"
GRAPHED = " graphed"  # a row whose iteration is the replay of one CUDA graph holding it whole
TORCH_GRAPHED = BASELINE + GRAPHED
GRAPH_WARMUP = 3  # eager iterations before a capture (the first step makes the momentum buffers)


def fused_backends(device: torch.device) -> List[str]:
    """The fused backends the rows run on ``device``: cuda and triton on a GPU, cpu on a CPU."""
    wanted = ("cuda", "triton") if device.type == "cuda" else ("cpu",)
    return [b for b in wanted if b in fk.available_backends(device)]


def optimizers(backends: List[str]) -> Dict[str, Callable[[List[torch.Tensor]], torch.optim.Optimizer]]:
    """Row name -> how to build its optimizer for a model's parameters."""
    out: Dict[str, Callable[[List[torch.Tensor]], torch.optim.Optimizer]] = {
        BASELINE: lambda ps: torch.optim.SGD(ps, fused=True, **SGD)
    }
    nar: Dict[str, Any] = dict(lr=SGD["lr"], weight_decay=SGD["weight_decay"], max_norm=1.0)
    for b in backends:  # partial: the same calls as lambdas binding b, and typed
        out[f"FedDecaySGD {b}"] = functools.partial(fk.FedDecaySGD, beta=1.0, backend=b, **SGD)
        out[f"FedDecaySGD {b} eager"] = functools.partial(fk.FedDecaySGD, beta=1.0, backend=b, replay=False, **SGD)
        out[f"FedNAR {b}"] = functools.partial(fk.FedNAR, backend=b, **nar)
        out[f"FedNAR {b} eager"] = functools.partial(fk.FedNAR, backend=b, replay=False, **nar)
        out[f"PAdaMFed {b}"] = functools.partial(fk.PAdaMFed, lr=0.01, beta=0.5, backend=b)
    return out


def graphed(backends: List[str]) -> Dict[str, Callable[[List[torch.Tensor]], torch.optim.Optimizer]]:
    """The rows whose whole iteration is one CUDA graph: torch's fused SGD (it has no ``capturable``
    flag: its fused step captures as it is) and the package's optimizers as ``optimizers`` builds them."""
    eager = optimizers(backends)
    out = {TORCH_GRAPHED: eager[BASELINE]}
    for b in backends:
        for name in (f"FedDecaySGD {b}", f"FedNAR {b}", f"PAdaMFed {b}"):
            out[name + GRAPHED] = eager[name]
    return out


@dataclass
class Row:
    """One model with one optimizer, its data, and the steps its timed blocks replayed."""

    model_name: str
    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor
    replay: Dict[str, int] = field(default_factory=lambda: {"eager": 0, "recorded": 0, "replayed": 0})

    def iteration(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(self.model(self.x), self.y).backward()
        self.opt.step()

    def stats(self) -> Optional[Dict[str, Any]]:
        get = getattr(self.opt, "replay_stats", None)
        return get() if get is not None else None

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Adds the steps the optimizer ran eagerly, recorded and replayed inside the block to ``replay``."""
        before = self.stats()
        yield
        after = self.stats()
        if before is not None and after is not None:
            for k in self.replay:
                self.replay[k] += after[k] - before[k]


@dataclass
class GraphedRow(Row):
    """A row whose iteration copies the batch into the graph's static input and replays one CUDA graph
    holding zero_grad (``set_to_none=False``: the gradients stay where the warm-up made them, which
    both fused backends can capture), forward, loss, backward and step."""

    graph: Any = None
    static: Optional[tuple] = None

    def eager_iteration(self) -> None:
        assert self.static is not None  # made by capture()
        self.opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(self.model(self.static[0]), self.static[1]).backward()
        self.opt.step()

    def capture(self, steps: int) -> None:
        """PyTorch's recipe: eager iterations on a side stream, then the capture; ``steps``: how many
        iterations the row will replay (what the optimizer's decay table must cover)."""
        self.static = (self.x.clone(), self.y.clone())
        prepare = getattr(self.opt, "prepare_capture", None)
        if prepare is not None:
            prepare(steps)
        side, current = torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(GRAPH_WARMUP):
                self.eager_iteration()
        current.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.eager_iteration()

    def iteration(self) -> None:
        assert self.static is not None
        self.static[0].copy_(self.x)
        self.static[1].copy_(self.y)
        self.graph.replay()

    def stats(self) -> Optional[Dict[str, Any]]:
        return None  # the steps are in the graph: the optimizer neither records nor replays them


def make_row(model_name: str, name: str, make_opt: Callable, device: torch.device, seed: int = 0) -> Row:
    torch.manual_seed(seed)
    model, shape, classes = MODELS[model_name]()
    model = model.to(device)
    opt = make_opt(list(model.parameters()))
    x = torch.randn((BATCH,) + shape, device=device)
    y = torch.randint(0, classes, (BATCH,), device=device)
    return (GraphedRow if name.endswith(GRAPHED) else Row)(model_name, name, model, opt, x, y)


def selected(makers: Dict[str, Callable], rows: Optional[List[str]]) -> Dict[str, Callable]:
    """The rows whose names start with one of ``rows``, with the baselines they are measured against."""
    if not rows:
        return makers
    out = {k: v for k, v in makers.items() if k == BASELINE or any(k.startswith(r) for r in rows)}
    if TORCH_GRAPHED in makers and any(k.endswith(GRAPHED) for k in out):
        out[TORCH_GRAPHED] = makers[TORCH_GRAPHED]
    return out
