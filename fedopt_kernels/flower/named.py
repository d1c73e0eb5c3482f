"""The paper-named strategies (``FedNARStrategy``, ``FedDynStrategy``, ...), generated from their
declarations (``naming.FlowerName``; the package's are ``paper_names.py``): keyword constructors
for ``strategy_for``'s strategies.

A named strategy's keywords are its variant chooser (``backbone=`` for FedNAR), the ``FLConfig``
fields (``lr``, ``local_steps``, the algorithm's own settings; its aliases, e.g. FedNAR's
``max_norm`` for ``clip_norm``) and ``FedOptStrategy``'s own (sampling, evaluation, ``seed``,
``state_tag``, ...), which win where a name is both. A declaration with its own keyword mapping
(PAdaMFed's ``num_rounds`` and ``clients_per_round``, which its theory step sizes read) maps them itself.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Dict, Tuple

from ..fl import algorithm
from ..fl.config import FLConfig
from ..fl.server_rules import RULES
from . import paper_names  # noqa: F401  (the package's declarations, made on import)
from .averaging import AveragingStrategy
from .base import FedOptStrategy
from .initial_controls import InitialControlsStrategy
from .naming import FlowerName, declared

_STRATEGY_KEYWORDS = frozenset(inspect.signature(FedOptStrategy.__init__).parameters) - {"self", "cfg"}
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(FLConfig))


def split_keywords(decl: FlowerName, args: Tuple[Any, ...], kw: Dict[str, Any]) -> Tuple[Dict, Dict]:
    """``(FLConfig keywords, strategy keywords)`` of a call of the strategy ``decl`` declares."""
    if len(args) > len(decl.positional):
        raise TypeError(f"{decl.name} takes {len(decl.positional)} positional arguments, got {len(args)}")
    # strict=False: a call may give fewer positional arguments than the strategy declares
    for name, value in zip(decl.positional, args, strict=False):
        if name in kw:
            raise TypeError(f"{decl.name} got {name!r} twice (by position and by keyword)")
        kw[name] = value
    if decl.keywords is not None:
        return decl.keywords(**kw)
    if isinstance(decl.variant, str):
        variant = decl.variant
    else:
        choices = dict(decl.variant)
        chosen = kw.pop(decl.choose, next(iter(choices)))
        if chosen not in choices:
            raise ValueError(f"{decl.choose} must be one of {tuple(choices)}, got {chosen!r}")
        variant = choices[chosen]
    cfg: Dict[str, Any] = {"algorithm": variant}
    strategy: Dict[str, Any] = {}
    for name, value in kw.items():
        field = decl.aliases.get(name, name)
        if name in _STRATEGY_KEYWORDS:
            strategy[name] = value
        elif field in _CONFIG_FIELDS and field != "algorithm":
            cfg[field] = value
        else:
            raise TypeError(f"{decl.name} got an unexpected keyword argument {name!r}")
    return cfg, strategy


def strategy_class(decl: FlowerName) -> type:
    """The strategy class ``decl`` names: an ``AveragingStrategy`` or, for a rule with an initial
    round of client controls, an ``InitialControlsStrategy``."""
    rules = {RULES[algorithm.variant(v).server].init_controls for v in decl.variants()}
    base = InitialControlsStrategy if rules == {True} else AveragingStrategy

    def __init__(self: FedOptStrategy, *args: Any, **kw: Any) -> None:
        cfg, strategy = split_keywords(decl, args, kw)
        base.__init__(self, FLConfig(**cfg), **strategy)

    a = algorithm.of(decl.variants()[0])
    runs = (
        decl.variants()[0]
        if isinstance(decl.variant, str)
        else f"{decl.choose}: " + ", ".join(f"{k!r} -> {v}" for k, v in dict(decl.variant).items())
    )
    doc = (
        f"{a.title or a.name} on Flower: ``fedopt-sim --algorithm`` {runs}, its client optimizer "
        f"``{a.optimizer.__name__}``.\n\n{decl.doc}\n\nKeywords: "
        + (", ".join(decl.positional) + " (also by position); " if decl.positional else "")
        + ("; ".join(f"{k} is {v}" for k, v in decl.aliases.items()) + "; " if decl.aliases else "")
        + "``FLConfig`` fields and ``FedOptStrategy``'s (sampling, evaluation, seed, ...). Generated from "
        "its declaration (``fedopt_kernels.flower.paper_names``)."
    )
    return type(decl.name, (base,), {"__init__": __init__, "__doc__": doc, "__module__": "fedopt_kernels.flower"})


_made: Dict[str, Tuple[FlowerName, type]] = {}


def named_strategy(name: str) -> type:
    """The strategy class called ``name`` (KeyError when none is declared)."""
    decl = declared()[name]
    made = _made.get(name)
    if made is None or made[0] is not decl:
        made = _made[name] = (decl, strategy_class(decl))
    return made[1]


def names() -> Tuple[str, ...]:
    """Every declared strategy name, in declaration order."""
    return tuple(declared())
