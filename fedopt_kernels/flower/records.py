"""Lists of tensors to Flower ``ArrayRecord``s and back, with the checks that reject a bad update.

A record holds one array per model parameter, keyed by the parameter's name. Reading one back
checks everything a client could get wrong (missing or extra names, wrong shapes, non-float or
non-finite values) and raises ``BadUpdate`` with a message saying what, so that a strategy can
leave that client out and log why instead of failing the round.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Sequence

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

Tensors = List[torch.Tensor]

# a child of Flower's logger: messages show in Flower's console output like its own
logger = logging.getLogger("flwr.fedopt_kernels")


class BadUpdate(ValueError):
    """A reply (or message) whose content cannot be used; the text says why."""


def to_record(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> ArrayRecord:
    """One numpy array per name, in order (the tensors are copied to the host)."""
    if len(names) != len(tensors):
        raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
    return ArrayRecord(
        {n: Array(np.ascontiguousarray(t.detach().cpu().numpy())) for n, t in zip(names, tensors, strict=True)}
    )


def from_record(record: ArrayRecord, names: Sequence[str], like: Sequence[torch.Tensor], what: str) -> Tensors:
    """The arrays of ``record`` as tensors shaped, typed and placed like ``like`` (one per name).

    Raises ``BadUpdate`` naming ``what`` (e.g. "delta") when a name is missing or extra, an array
    has the wrong shape, is not floating point, or holds NaN/inf.
    """
    if not isinstance(record, ArrayRecord):
        raise BadUpdate(f"{what} is a {type(record).__name__}, expected an ArrayRecord")
    missing = [n for n in names if n not in record]
    extra = [k for k in record.keys() if k not in set(names)]
    if missing or extra:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unexpected {extra}"] if extra else [])
        raise BadUpdate(f"{what} has the wrong arrays: {', '.join(parts)}")
    out = []
    for name, ref in zip(names, like, strict=True):
        try:
            arr = record[name].numpy()
        except Exception as exc:  # a foreign serialisation: say so instead of a deep traceback
            raise BadUpdate(f"{what}[{name!r}] cannot be read as a numpy array ({exc})") from None
        if tuple(arr.shape) != tuple(ref.shape):
            raise BadUpdate(f"{what}[{name!r}] has shape {tuple(arr.shape)}, expected {tuple(ref.shape)}")
        if arr.dtype.kind != "f":
            raise BadUpdate(f"{what}[{name!r}] has dtype {arr.dtype}, expected a floating-point array")
        if not np.isfinite(arr).all():
            raise BadUpdate(f"{what}[{name!r}] holds non-finite values (NaN or inf)")
        out.append(torch.from_numpy(np.array(arr)).to(device=ref.device, dtype=ref.dtype))
    return out


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def get_record(content: RecordDict, key: str, kind: type, what: str):
    """``content[key]`` when it is a ``kind`` record; BadUpdate naming ``what`` otherwise."""
    if key not in content:
        raise BadUpdate(f"{what}: the reply has no {kind.__name__} {key!r}")
    rec = content[key]
    if not isinstance(rec, kind):
        raise BadUpdate(f"{what}: {key!r} is a {type(rec).__name__}, expected a {kind.__name__}")
    return rec


def metric(content: RecordDict, name: str, what: str = "metrics") -> float:
    """A finite number from the reply's MetricRecord "metrics"; BadUpdate otherwise."""
    rec = get_record(content, "metrics", MetricRecord, what)
    if name not in rec:
        raise BadUpdate(f"{what}: the MetricRecord has no {name!r}")
    v = rec[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
        raise BadUpdate(f"{what}: {name!r} must be a finite number, got {v!r}")
    return float(v)


MAX_EXAMPLES = 2**53  # the largest count every integer below which a float64 holds exactly


def example_count(content: RecordDict, allow_zero: bool = False) -> float:
    """The reply's ``num-examples``: an integer in [1, 2**53] ([0, 2**53] with ``allow_zero``); BadUpdate otherwise.

    The bound keeps every count exact in float64 and any sum of counts far from overflow, so the
    aggregation weights always sum to 1.
    """
    rec = get_record(content, "metrics", MetricRecord, "metrics")
    if "num-examples" not in rec:
        raise BadUpdate("metrics: the MetricRecord has no 'num-examples'")
    v = rec["num-examples"]
    integral = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
    low = 0 if allow_zero else 1
    if isinstance(v, bool) or not integral or not low <= v <= MAX_EXAMPLES:
        raise BadUpdate(f"num-examples must be an integer in [{low}, 2**53], got {v!r}")
    return float(v)


def as_int(value: Any) -> int:
    """``int(value)`` of an integer a record holds (flwr types a record's values as any of its kinds)."""
    return int(value)


def config_dict(content: RecordDict, key: str = "config") -> Dict[str, object]:
    rec = get_record(content, key, ConfigRecord, "message")
    return dict(rec)
