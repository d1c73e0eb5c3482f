"""Each algorithm's FL descriptor, one module per algorithm, named as its optimizer's module in
``optim/``: its client side of a round (an ``Algorithm`` subclass), its variants, its own run
settings, its catalogue option sets and, when it brings one, its server rule (docs/dispatch.md).

A module registers its descriptor when it is imported (``fedopt_kernels.fl.algorithm.register``).
Every module of this package is imported here, in the order of their names: the order of
``ALGORITHMS``, of the simulator's choices and of the README's table. A new descriptor is found
by being here; nothing lists it. ``fedopt_kernels/__init__.py`` imports this package.
"""

import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
