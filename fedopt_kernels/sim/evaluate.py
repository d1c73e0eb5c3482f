"""Evaluation: pooled loss/accuracy, and the FedDecay papers' per-user protocol (FedDecay paper,
Sec. 4.1-4.2; docs/algorithms.md lists the papers).

After training, every user (new and existing) fine-tunes the global model on its own train split
(``finetune_steps`` SGD steps of lr ``finetune_lr`` on its mini-batches) and is tested on its test
split. Across users we report the mean accuracy, the bottom-10% accuracy (the 10th percentile of the
per-user accuracies: 90% of users do at least this well) and the standard deviation; users count
equally, whatever their size. The global model's accuracy before fine-tuning is reported the same way.

Each necessary forward pass runs once: the global model's pooled numbers and every user's accuracy
come from one pass over the users' split (``split_scores``), and each fine-tuned model sees its
user's test split once. With ``at_once`` (the client-batched simulator's chunk size) the users
fine-tune ``at_once`` at a time like client-batched training (``batched/``: stacked clients,
padded batches, the same plain SGD) and their fine-tuned models are evaluated stacked; each user
gets what ``finetune`` then its test pass give it alone (``--validate sequential`` compares them).

``EvalCost`` adds up the seconds and the model FLOPs (forward passes, and the fine-tuning's forward
and backward passes; ``torch.utils.flop_counter`` on one sample, times the samples) of what it is
given to, so a run can report evaluation FLOP/s.

``precision`` (``batched/precision.py``): every forward pass, and the fine-tuning's backward passes,
compute in the run's precision; the fine-tuning's SGD update is float32.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from .batched.precision import autocast_scope, precision_scope
from .data.clients import BatchStream, ClientData
from .data.image_input import ImageClassifier

# samples per forward pass when scoring: on a CPU small enough for the caches (FedAvg CNN, 1 thread:
# 61-62 GFLOP/s at 64-512 samples in channels-last, 34 at 4096); on a GPU large enough to fill it
EVAL_CHUNK = {"cpu": 256}
EVAL_CHUNK_DEVICE = 4096


def eval_chunk(device: torch.device) -> int:
    return EVAL_CHUNK.get(device.type, EVAL_CHUNK_DEVICE)


@dataclass
class EvalCost:
    """Seconds and model FLOPs spent evaluating (module docstring)."""

    seconds: float = 0.0
    flops: float = 0.0
    samples: int = 0
    parts: Dict[str, float] = field(default_factory=dict)  # seconds per part

    def add(self, part: str, seconds: float, flops: float, samples: int = 0) -> None:
        self.seconds += seconds
        self.flops += flops
        self.samples += samples
        self.parts[part] = self.parts.get(part, 0.0) + seconds

    def as_dict(self) -> Dict[str, Any]:
        rate = self.flops / self.seconds if self.seconds > 0 else float("nan")
        return {
            "seconds": self.seconds,
            "flops": self.flops,
            "flops_per_s": rate,
            "samples": self.samples,
            "parts_s": dict(self.parts),
        }


@dataclass
class Scores:
    """Per-user summed cross-entropy, correct predictions and samples of one split."""

    loss: np.ndarray
    correct: np.ndarray
    count: np.ndarray

    def pooled(self) -> Dict[str, float]:
        n = max(int(self.count.sum()), 1)
        return {"loss": float(self.loss.sum()) / n, "acc": int(self.correct.sum()) / n}

    def accuracy(self) -> List[float]:
        """Each user's accuracy (users with no samples: NaN)."""
        return [c / n if n else float("nan") for c, n in zip(self.correct.tolist(), self.count.tolist(), strict=True)]


# ------------------------------------------------------------------ the global model
def _eval_call(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``model`` in eval mode as a function of a batch. On a CPU, convolutional models run through the
    layers engine as one client with channels-last convolutions (``batched/layers.py``,
    ``grouped-nhwc``): oneDNN's faster layout, which also keeps the pooling and element-wise layers
    after each convolution in it (a plain call on 1-channel images runs the first block in NCHW, where
    max-pooling is 8x slower). The model's own parameters are untouched."""
    net = model.net if isinstance(model, ImageClassifier) else model
    stage = model.preprocess if isinstance(model, ImageClassifier) else None
    p0 = next(net.parameters(), None)
    plain = lambda x: net(x if stage is None else stage(x, False))  # noqa: E731
    if p0 is None or p0.device.type != "cpu" or not any(isinstance(m, nn.Conv2d) for m in net.modules()):
        return plain
    from .batched.layers import Clients
    from .batched.layers_engine import LayersNet, UnsupportedModel

    try:
        layered = LayersNet(net)
    except UnsupportedModel:
        return plain
    layered.set_formulations({"Conv2d": "grouped-nhwc"})
    one = [p.detach().unsqueeze(0) for p in net.parameters()]

    def call(x: torch.Tensor) -> torch.Tensor:
        x = x if stage is None else stage(x, False)
        return layered(one, x, Clients(1, x.shape[0]))

    return call


# per live model: held weakly, so a freed model's counts go with it (a cache keyed by id() answered a
# new model at a freed model's address with the old model's count)
_FLOPS: weakref.WeakKeyDictionary[nn.Module, Dict[Tuple[Tuple[int, ...], str], float]] = weakref.WeakKeyDictionary()


def _counted(model: nn.Module, x: torch.Tensor, kind: str, run: Callable[[], object]) -> float:
    """FLOPs ``torch.utils.flop_counter`` counts in ``run()`` with ``model`` in eval mode, cached per
    model, sample shape and ``kind``."""
    per_model = _FLOPS.setdefault(model, {})
    key = (tuple(x.shape[1:]), kind)
    if key not in per_model:
        was = model.training
        model.eval()  # no augmentation draw: the run's random streams stay untouched
        try:
            with FlopCounterMode(display=False) as counter:
                run()
        finally:
            model.train(was)
        per_model[key] = float(counter.get_total_flops())
    return per_model[key]


def forward_flops(model: nn.Module, x: torch.Tensor) -> float:
    """Model FLOPs of one forward pass of one sample like ``x[:1]`` (matmuls and convolutions, as
    ``torch.utils.flop_counter`` counts them); cached per model and sample shape."""

    def run() -> None:
        with torch.no_grad():
            model(x[:1])

    return _counted(model, x, str(x.dtype), run)


@torch.no_grad()
def split_scores(
    model: nn.Module,
    clients: Sequence[ClientData],
    split: str,
    cost: Optional[EvalCost] = None,
    precision: str = "fp32",
) -> Scores:
    """Every client's summed loss, correct predictions and count on its ``split`` ("val" or "test"):
    one forward pass over the union of the clients' splits, in chunks of ``eval_chunk(device)``, in
    ``precision``."""
    start = time.perf_counter()
    xs = [getattr(c, f"{split}_x") for c in clients]
    ys = [getattr(c, f"{split}_y") for c in clients]
    counts = np.array([int(y.shape[0]) for y in ys], dtype=np.int64)
    loss = np.zeros(len(clients), dtype=np.float64)
    correct = np.zeros(len(clients), dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return Scores(loss, correct, counts)
    x, y = torch.cat(xs), torch.cat(ys)
    owner = torch.repeat_interleave(
        torch.arange(len(clients), device=y.device), torch.as_tensor(counts, device=y.device)
    )
    was = model.training
    model.eval()
    call = _eval_call(model)
    per_loss = torch.empty(total, dtype=torch.float64, device=y.device)
    per_hit = torch.empty(total, dtype=torch.bool, device=y.device)
    step = eval_chunk(y.device)
    try:
        with precision_scope(precision, y.device), autocast_scope(precision, y.device):
            for i in range(0, total, step):
                out = call(x[i : i + step])
                yy = y[i : i + step]
                per_loss[i : i + step] = F.cross_entropy(out, yy, reduction="none")
                per_hit[i : i + step] = out.argmax(dim=1) == yy
    finally:
        model.train(was)
    sums = torch.zeros(len(clients), dtype=torch.float64, device=y.device).index_add_(0, owner, per_loss)
    hits = torch.zeros(len(clients), dtype=torch.int64, device=y.device).index_add_(0, owner, per_hit.long())
    loss[:] = sums.cpu().numpy()
    correct[:] = hits.cpu().numpy()
    if cost is not None:
        cost.add(f"forward {split}", time.perf_counter() - start, forward_flops(model, x) * total, total)
    return Scores(loss, correct, counts)


def pooled_metrics(
    model: nn.Module,
    clients: Sequence[ClientData],
    split: str,
    cost: Optional[EvalCost] = None,
    precision: str = "fp32",
) -> Dict[str, float]:
    """Loss and accuracy over the union of the clients' ``split`` ("val" or "test") data."""
    return split_scores(model, clients, split, cost, precision).pooled()


def user_summary(accs: Sequence[float]) -> Dict[str, float]:
    """Mean, bottom-10% (10th percentile, linear interpolation) and population std of per-user accuracies."""
    if len(accs) == 0:
        return {"mean": float("nan"), "bottom10": float("nan"), "std": float("nan"), "users": 0}
    a = np.asarray(accs, dtype=np.float64)
    return {
        "mean": float(a.mean()),
        "bottom10": float(np.quantile(a, 0.1)),
        "std": float(a.std()),
        "users": int(a.size),
    }


def user_accuracy(model: nn.Module, client: ClientData) -> float:
    return split_scores(model, [client], "test").accuracy()[0]


# ------------------------------------------------------------------ fine-tuning, one user at a time
def finetune(
    model: nn.Module, client: ClientData, steps: int, lr: float, stream: BatchStream, precision: str = "fp32"
) -> int:
    """``steps`` plain SGD steps on the client's train mini-batches (not part of the FL algorithm),
    forward and backward in ``precision``; returns the samples they saw."""
    if steps == 0:
        return 0
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    seen = 0
    for _ in range(steps):
        x, y = stream.next()
        opt.zero_grad(set_to_none=True)
        with precision_scope(precision, y.device):
            with autocast_scope(precision, y.device):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        opt.step()
        seen += int(y.shape[0])
    return seen


def _train_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Model FLOPs of one training step (forward and backward) on one sample like ``x[:1]``."""

    def run() -> None:
        F.cross_entropy(model(x[:1]), y[:1]).backward()
        model.zero_grad(set_to_none=True)

    return _counted(model, x, "train", run)


def _finetuned_sequential(
    model: nn.Module,
    users: Sequence[ClientData],
    load: Callable[[], None],
    steps: int,
    lr: float,
    make_stream: Callable[[ClientData], BatchStream],
    cost: Optional[EvalCost],
    precision: str,
) -> List[float]:
    after = []
    for u in users:
        load()
        start = time.perf_counter()
        samples = finetune(model, u, steps, lr, make_stream(u), precision)
        if cost is not None and samples:
            cost.add("fine-tune", time.perf_counter() - start, _train_flops(model, u.train_x, u.train_y) * samples)
        after.append(split_scores(model, [u], "test", cost, precision).accuracy()[0])
    return after


# ------------------------------------------------------------------ fine-tuning, client-batched
def _finetuned_batched(
    model: nn.Module,
    users: Sequence[ClientData],
    global_params: List[torch.Tensor],
    steps: int,
    lr: float,
    make_stream: Callable[[ClientData], BatchStream],
    at_once: int,
    cost: Optional[EvalCost],
    precision: str,
) -> List[float]:
    """Fine-tune and test ``users`` ``at_once`` at a time: stacked copies of the global model,
    each user's own batches (padded, weighted 1/n), ``p -= lr * g`` per user, then every user's
    fine-tuned model on its own test split (padded, masked), stacked."""
    from .batched.batches import BatchPool, apply_stage
    from .batched.loss import client_loss

    engine = client_loss(model, precision=precision)
    random = isinstance(model, ImageClassifier) and model.spec.augment  # fine-tuning runs in train mode
    streams = {u.client_id: make_stream(u) for u in users}
    pool = BatchPool(list(users), streams[users[0].client_id].batch_size, dtype=global_params[0].dtype)
    chunks = math.ceil(len(users) / at_once)
    size = math.ceil(len(users) / chunks)
    after: List[float] = []
    was = model.training
    for i in range(0, len(users), size):
        chunk = list(users[i : i + size])
        C = len(chunk)
        params = [g.detach().unsqueeze(0).repeat(C, *([1] * g.dim())) for g in global_params]
        if steps:
            start = time.perf_counter()
            model.train()
            batches = pool.draw(streams, [u.client_id for u in chunk], steps)
            x = apply_stage(engine.input_stage, batches, random)
            for k in range(steps):
                grads, _ = engine.grads(params, x[k], batches.y[k], batches.w[k])
                with torch.no_grad():
                    for p, g in zip(params, grads, strict=True):
                        p.add_(g, alpha=-lr)  # torch.optim.SGD's update, per user
            model.train(was)
            if cost is not None:
                flops = _train_flops(model, chunk[0].train_x, chunk[0].train_y) * int(batches.counts.sum())
                cost.add("fine-tune", time.perf_counter() - start, flops)
        after += _stacked_accuracy(model, engine, params, chunk, cost)
    return after


@torch.no_grad()
def _stacked_accuracy(model, engine, params, users: Sequence[ClientData], cost: Optional[EvalCost]) -> List[float]:
    """User c's model (row c of ``params``) on user c's test split, all users at once."""
    start = time.perf_counter()
    n = [int(u.test_y.shape[0]) for u in users]
    T = max(n)
    hits = [0] * len(users)
    was = model.training
    model.eval()
    step = max(1, eval_chunk(params[0].device) // len(users))
    for t0 in range(0, T, step):
        t1 = min(t0 + step, T)
        # rows past a user's end repeat its last sample; they are not counted
        idx = [torch.clamp(torch.arange(t0, t1), max=k - 1) for k in n]
        x = torch.stack([u.test_x[i.to(u.test_x.device)] for u, i in zip(users, idx, strict=True)])
        y = torch.stack([u.test_y[i.to(u.test_y.device)] for u, i in zip(users, idx, strict=True)])
        if engine.input_stage is not None:
            flat = engine.input_stage(x.flatten(0, 1), False)
            x = flat.view(x.shape[0], x.shape[1], *flat.shape[1:])
        right = (engine.logits(params, x).argmax(-1) == y).cpu()
        for c, k in enumerate(n):
            hits[c] += int(right[c, : max(0, min(k, t1) - t0)].sum())
    model.train(was)
    if cost is not None:
        total = sum(n)
        cost.add(
            "forward fine-tuned", time.perf_counter() - start, forward_flops(model, users[0].test_x) * total, total
        )
    return [h / k for h, k in zip(hits, n, strict=True)]


# ------------------------------------------------------------------ the protocol
def evaluate_users(
    model: nn.Module,
    global_params: List[torch.Tensor],
    groups: Dict[str, Sequence[ClientData]],
    steps: int,
    lr: float,
    make_stream: Callable[[ClientData], BatchStream],
    at_once: Optional[int] = None,
    cost: Optional[EvalCost] = None,
    precision: str = "fp32",
    share: Optional[Callable[[int], Tuple[int, int]]] = None,
    gather: Optional[Callable[[Any], List[Any]]] = None,
) -> Dict[str, Dict]:
    """The per-user protocol for each group of users ("existing", "new").

    Returns ``{"global": {group: summary}, "finetuned": {group: summary}, "pooled_test_acc": acc}``,
    the last over every group's users (from the same pass as the global per-user numbers).
    ``at_once``: fine-tune and test that many users at a time, client-batched; None: one after
    another. ``cost`` adds up the seconds and FLOPs; ``precision``: what the passes compute in.
    ``model`` is used as scratch space and is left holding ``global_params``.

    Several processes (``sim/ranks.py``): ``share(n)`` is this process's block ``[lo, hi)`` of a
    group of n users, and ``gather(x)`` every process's ``x`` in order; each evaluates its blocks,
    and every per-user number is put back in user order before the summaries.
    """

    def load() -> None:
        with torch.no_grad():
            for p, g in zip(model.parameters(), global_params, strict=True):
                p.copy_(g)

    tested = {name: [u for u in users if u.test_y.shape[0] > 0] for name, users in groups.items()}
    blocks = {name: (share or (lambda n: (0, n)))(len(users)) for name, users in tested.items()}
    mine = {name: users[blocks[name][0] : blocks[name][1]] for name, users in tested.items()}
    everyone = [u for users in mine.values() for u in users]
    load()
    scores = split_scores(model, everyone, "test", cost, precision)  # the global model: one pass for all numbers
    before = scores.accuracy()
    after: Dict[str, List[float]] = {}
    k = 0
    for name, users in mine.items():
        if steps == 0:
            after[name] = before[k : k + len(users)]
        elif at_once is not None and at_once > 1 and users:
            after[name] = _finetuned_batched(
                model, users, global_params, steps, lr, make_stream, at_once, cost, precision
            )
        else:
            after[name] = _finetuned_sequential(model, users, load, steps, lr, make_stream, cost, precision)
        k += len(users)
    load()
    if gather is not None:  # every process's blocks, back in user order: group by group, rank by rank
        mine_parts, k = {}, 0
        for name, users in mine.items():
            n = len(users)
            cut = slice(k, k + n)
            mine_parts[name] = (scores.loss[cut], scores.correct[cut], scores.count[cut], before[cut], after[name])
            k += n
        every = gather(mine_parts)
        per = {name: [p[name] for p in every] for name in tested}
        scores = Scores(*(np.concatenate([q[i] for name in tested for q in per[name]]) for i in range(3)))
        before = [a for name in tested for q in per[name] for a in q[3]]
        after = {name: [a for q in per[name] for a in q[4]] for name in tested}
    out: Dict[str, Any] = {"global": {}, "finetuned": {}, "pooled_test_acc": scores.pooled()["acc"]}
    k = 0
    for name, users in tested.items():
        out["global"][name] = user_summary(before[k : k + len(users)])
        out["finetuned"][name] = user_summary(after[name])
        k += len(users)
    return out
