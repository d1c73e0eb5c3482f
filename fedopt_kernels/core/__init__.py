"""The kernel layer: ops declared once, the backend registry, the base optimizer and its step plan.

Nothing here knows about federated learning: the layers above (``fl``, ``optim``, the front ends)
import from here, never the reverse (tests/test_layers.py). This ``__init__`` imports nothing, so
that the C++ build can load ``op_header.py`` and ``ops.py`` with only torch present.
"""
