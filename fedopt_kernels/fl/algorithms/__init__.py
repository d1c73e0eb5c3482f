"""Each algorithm's FL descriptor, one module per algorithm, named as its optimizer's module in
``optim/``: its client side of a round (an ``Algorithm`` subclass), its variants, its own run
settings, its catalogue option sets and, when it brings one, its server rule (docs/dispatch.md).

A module registers its descriptor when it is imported (``fedopt_kernels.fl.algorithm.register``),
in the order below: the order of ``ALGORITHMS``, of the simulator's choices and of the README's
table (not sorted). ``fedopt_kernels/__init__.py`` imports this package.
"""

# isort: off
from . import feddecay, neuron_lr, fednar, padamfed, feddyn, fedsam  # noqa: F401

# isort: on
