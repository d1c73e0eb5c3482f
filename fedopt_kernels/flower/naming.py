"""What a paper-named Flower strategy is (``FlowerName``) and the names declared so far (``declare``).

The package's own declarations are ``paper_names.py``; an algorithm registered later declares its
own with ``declare`` (after its descriptor: a declaration names registered variants).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

from ..fl import algorithm

# (FLConfig keywords, strategy keywords) from a Flower strategy constructor's keywords
StrategyKeywords = Callable[..., Tuple[Dict[str, Any], Dict[str, Any]]]


@dataclass(frozen=True)
class FlowerName:
    """A paper-named Flower strategy (``fedopt_kernels.flower.<name>``), generated from this declaration.

    ``variant``: the variant it runs, or ``{value of keyword choose: variant}`` (FedNAR's
    ``backbone``); ``positional``: keywords that may also be given by position; ``aliases``:
    constructor keyword -> ``FLConfig`` field (FedNAR's ``max_norm`` is ``clip_norm``). Other
    keywords go to ``FLConfig`` or to the strategy (sampling, evaluation, ``seed``, ...). ``keywords``:
    a function that maps the constructor's keywords itself, returning ``(FLConfig keywords, strategy
    keywords)`` (PAdaMFed: the theory step sizes need the round and client counts).
    """

    name: str
    variant: Union[str, Mapping[Any, str]]
    choose: str = ""
    positional: Tuple[str, ...] = ()
    aliases: Mapping[str, str] = field(default_factory=dict)
    keywords: Optional[StrategyKeywords] = None
    doc: str = ""

    def variants(self) -> Tuple[str, ...]:
        return (self.variant,) if isinstance(self.variant, str) else tuple(self.variant.values())

    @property
    def algorithm(self) -> str:
        """The algorithm whose variants it runs."""
        return algorithm.variant(self.variants()[0]).algorithm


_DECLARED: Dict[str, FlowerName] = {}


def declare(decl: FlowerName) -> FlowerName:
    """Add ``decl``; its variants are one registered algorithm's, its name is not taken (ValueError)."""
    if decl.name in _DECLARED:
        raise ValueError(f"Flower strategy name {decl.name} is taken")
    owners = {algorithm.variant(v).algorithm for v in decl.variants()}
    if len(owners) != 1:
        raise ValueError(f"Flower strategy {decl.name} names variants {decl.variants()} of several algorithms")
    _DECLARED[decl.name] = decl
    return decl


def withdraw(name: str) -> None:
    """Remove declaration ``name`` (a test's algorithm)."""
    del _DECLARED[name]


def declared() -> Dict[str, FlowerName]:
    """Every declared strategy name -> its declaration, in declaration order, for registered algorithms."""
    return {n: d for n, d in _DECLARED.items() if all(v in algorithm.VARIANTS for v in d.variants())}
