"""The client side: one round of local training with this package's optimizers, from a received message.

``train_round`` is what a ``ClientApp``'s train function calls: it loads the global model from the
message and runs the round as ``fedopt-sim`` does, through the one client round
(``fedopt_kernels.fl.client_round.ClientRound``: the algorithm's optimizer, hyperparameters,
per-round lr, FedNLR scales, round index, local steps, the update and what the client keeps and
replies); this module supplies the message, the client's state and the forward/backward, and
returns the reply content the strategies expect:

* ``"delta"`` (ArrayRecord): the trained model minus the received one;
* the server rule's reply tensors (``"dc"``, SCAFFOLD and PAdaMFed: the change of the client's control variate);
* ``"metrics"`` (MetricRecord): ``num-examples`` (the aggregation weight), ``train-loss``, the
  server rule's numbers (FedNova's ``nova-a``) and, when given, ``client-id`` (the strategy sums
  clients in this order, as the simulator does).

What the client keeps between rounds (its control variate ``c_i``, FedDyn's ``g_i``) never leaves
the client: it lives in ``context.state`` under ``"<state-tag>.control"``. A non-finite new control
is not stored (the old one is kept), so one bad round cannot poison the client's later rounds.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable, Dict, List, Mapping, Optional, Tuple, cast

import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import nn
from torch.nn import functional as F

from ..fl.client_round import ClientRound, loss_and_correct
from ..fl.work import own_steps
from .records import Tensors, all_finite, config_dict, from_record, get_record, to_record
from .settings import WORK_FRACTION, read_round_config

if TYPE_CHECKING:
    from flwr.app import MetricRecordValues

Batch = Tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _named(model: nn.Module) -> Tuple[list, Tensors]:
    named = list(model.named_parameters())
    return [n for n, _ in named], [p for _, p in named]


@torch.no_grad()
def _load_global(model: nn.Module, content: RecordDict) -> Tuple[list, Tensors, Tensors]:
    """Copy the received global model into ``model``; returns (names, parameters, global tensors)."""
    names, params = _named(model)
    x = from_record(get_record(content, "arrays", ArrayRecord, "message"), names, params, "arrays")
    for p, g in zip(params, x, strict=True):
        p.copy_(g)
    return names, params, x


def _control_key(tag: str) -> str:
    return f"{tag}.control"


def _stored_control(state: RecordDict, tag: str, names: list, like: Tensors) -> Optional[Tensors]:
    rec = state.get(_control_key(tag)) if _control_key(tag) in state else None
    # an ArrayRecord: _store_control is what writes this key
    return None if rec is None else from_record(cast(ArrayRecord, rec), names, like, "stored control")


def _store_control(state: RecordDict, tag: str, names: list, ci: Tensors) -> None:
    if all_finite(ci):
        state[_control_key(tag)] = to_record(names, ci)


def _metrics(num_examples: int, client_id: Optional[int], **values: float) -> MetricRecord:
    m: Dict[str, MetricRecordValues] = {
        "num-examples": int(num_examples),
        **{k.replace("_", "-"): float(v) for k, v in values.items()},
    }
    if client_id is not None:
        m["client-id"] = int(client_id)
    return MetricRecord(m)


def _gradients(model: nn.Module, loss_fn: LossFn, batch: Batch) -> torch.Tensor:
    """Forward/backward of ``batch`` on ``model``: its gradients in ``.grad``; the (detached) loss."""
    bx, by = batch
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(bx), by)
    loss.backward()
    return loss.detach()


def _grads_at(model: nn.Module, loss_fn: LossFn, batch: Batch) -> List[torch.Tensor]:
    _gradients(model, loss_fn, batch)
    return [cast(torch.Tensor, p.grad) for p in model.parameters()]


def train_round(
    model: nn.Module,
    next_batch: Callable[[], Batch],
    content: RecordDict,
    state: RecordDict,
    *,
    num_examples: int,
    client_id: Optional[int] = None,
    calibration: Optional[Batch] = None,
    backend: str = "auto",
    loss_fn: LossFn = F.cross_entropy,
) -> RecordDict:
    """One round of local training on ``model`` from a train message's ``content``; returns the reply content.

    ``next_batch()`` gives the client's next mini-batch; ``num_examples`` is its training-set size
    (the aggregation weight). ``calibration`` (inputs, targets) is the data FedNLR computes its
    neuron scales on (the simulator uses the whole training split); other algorithms ignore it.
    ``state`` is ``context.state``: it keeps the control variate between rounds.
    """
    config = config_dict(content)
    cfg, hp, t, tag = read_round_config(config)
    names, params, x = _load_global(model, content)
    # a fresh client round (and optimizer) per round, advanced to round t: its per-round state restarts anyway
    rnd = ClientRound(cfg, hp, model, backend)
    # its own steps: the round's local_steps (the strategy drew it), or its epochs; a straggler's fewer
    fraction = config.get(WORK_FRACTION)
    rnd.plan(t, {client_id: own_steps(cfg, num_examples, None if fraction is None else float(cast(float, fraction)))})
    got: Mapping[str, Tensors] = {
        key: from_record(get_record(content, rec, ArrayRecord, "message"), names, params, rec)
        for rec, key in rnd.rule.sent.items()
    }
    kept = _stored_control(state, tag, names, params) if rnd.rule.keeps else None
    client = SimpleNamespace(train_x=calibration[0], train_y=calibration[1]) if calibration is not None else None
    anchor = copy.deepcopy(model) if rnd.needs_anchor else None
    opt = rnd.begin(0, t, got, kept, x, client, anchor)

    def step() -> torch.Tensor:
        batch = next_batch()
        # PAdaMFed-VR: the same batch's gradient at the round's starting model
        anchor_grads = None if anchor is None else (lambda: _grads_at(anchor, loss_fn, batch))
        return rnd.step(opt, lambda: _gradients(model, loss_fn, batch), anchor_grads)

    K = rnd.steps(client_id, t)
    loss = rnd.train(step, K, params[0].device)
    result = rnd.finish(opt, t, K, params, x, got, kept)
    out = RecordDict()
    out["delta"] = to_record(names, result.delta)
    for name, tensors in result.reply.items():
        out[name] = to_record(names, tensors)
    if result.new_kept is not None:
        _store_control(state, tag, names, result.new_kept)
    out["metrics"] = _metrics(num_examples, client_id, train_loss=loss, **result.scalars)
    return out


def init_controls_round(
    model: nn.Module,
    next_batch: Callable[[], Batch],
    content: RecordDict,
    state: RecordDict,
    *,
    num_examples: int,
    client_id: Optional[int] = None,
    loss_fn: LossFn = F.cross_entropy,
) -> RecordDict:
    """The initial round of a rule with initial controls (PAdaMFed's): ``c_i`` = mean of K stochastic
    gradients at the received model (``ClientRound.initial_control``), for the ``INIT_MESSAGE_TYPE`` message.

    Kept in ``state`` and returned as ``"control"`` (the server averages them into ``c`` and ``m``).
    """
    cfg, hp, _, tag = read_round_config(config_dict(content))
    names, params, _ = _load_global(model, content)
    rnd = ClientRound(cfg, hp, model, "auto")
    ci = rnd.initial_control(lambda: _gradients(model, loss_fn, next_batch()), params, rnd.initial_steps(client_id))
    _store_control(state, tag, names, ci)
    return RecordDict({"control": to_record(names, ci), "metrics": _metrics(num_examples, client_id)})


def evaluate_round(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, content: RecordDict, *, client_id: Optional[int] = None
) -> RecordDict:
    """Loss and accuracy of the received global model on (x, y) (e.g. the client's validation split)."""
    _load_global(model, content)
    n = int(y.shape[0])
    loss, correct = loss_and_correct(model, x, y) if n else (0.0, 0)
    return RecordDict({"metrics": _metrics(n, client_id, eval_loss=loss / max(n, 1), eval_acc=correct / max(n, 1))})
