"""Compiled or interpreted: which mode the kernels run in, and the decorator for device helpers.

``TRITON_INTERPRET=1`` is read when a kernel is *decorated* (``triton.jit`` then returns an
interpreter object), so the mode is fixed when ``fedopt_kernels.triton_kernels`` is imported.
Things the interpreter does differently, and how the kernels cope:

* every call of a jitted helper re-patches ``triton.language`` (~3 ms): ``device_fn`` below;
* float32 -> bfloat16 casts truncate instead of rounding: ``tiles.f32_to_bf16`` (integer RTNE);
* plain Python floats are passed through untyped (the ``tl.float32`` annotation only types the
  compiled argument): every hyperparameter is only ever combined with float32 tensors (or, for
  ``lr * s(j)``, with the float64 schedule value), where both modes promote the same way;
* each program runs as Python over numpy lanes: few, wide programs (``plans.pick_tile``);
* 32-bit integer ops are overflow-checked (slow): wide integer math stays 64-bit there;
* a runtime scalar (an argument, ``program_id``) is a one-element 1-d numpy array, which ``range``
  turns into an int through the interpreter's ``__index__``; Triton 3.6's (what torch 2.10 and 2.11
  install) calls ``int()`` on the array, which NumPy >= 2.4 refuses for arrays that are not 0-d:
  every ``range`` bound that is not a constexpr goes through ``loop_bound``;
* a constexpr tuple (a kernel's named bundle of element types or flags, ``DT``, ``HAS``, ``TILE``)
  reaches a helper as one ``tl.constexpr``, which Triton 3.6's interpreter cannot unpack (3.8's
  can): ``device_fn`` passes its items instead.
"""

from __future__ import annotations

import triton
import triton.language as tl


def interpreted() -> bool:
    """True when Triton kernels decorated now run in the interpreter (TRITON_INTERPRET=1)."""
    return bool(triton.knobs.runtime.interpret)


@triton.jit
def _same(x):
    return x


def _interpreted_bound(x):
    """The Python int of an interpreted scalar (constexprs and ints pass through)."""
    data = getattr(getattr(x, "handle", None), "data", None)
    return x if data is None else int(data.item())


# ``x`` as a ``range`` bound: compiled, the value itself (inlined, nothing emitted); interpreted, its
# Python int, whatever the interpreter's own conversion accepts. Fixed at import, like the kernels.
loop_bound = _interpreted_bound if interpreted() else _same


def _items(arg):
    """A constexpr tuple as a tuple of constexprs (module docstring); anything else as it is."""
    value = getattr(arg, "value", None) if isinstance(arg, tl.constexpr) else None
    if isinstance(value, tuple):
        return tuple(v if isinstance(v, tl.constexpr) else tl.constexpr(v) for v in value)
    return arg


def device_fn(fn):
    """``triton.jit`` for device helper functions called from kernels.

    Under the interpreter every call of a jitted helper re-patches ``triton.language`` (about 3 ms
    per call, which dominated a step); the helper is then called as its interpreter-rewritten
    Python function directly, inside the patch its calling kernel already holds. Compiled, this
    is exactly ``triton.jit``.
    """
    jitted = triton.jit(fn)
    rewrite = getattr(jitted, "rewrite", None)
    if not interpreted() or rewrite is None:
        return jitted

    class _Direct:
        __name__ = fn.__name__
        __doc__ = fn.__doc__
        fn_interpreted = jitted

        def __init__(self):
            self._fn = None

        def __call__(self, *args, **kwargs):
            if self._fn is None:
                self._fn = rewrite()
            return self._fn(*map(_items, args), **{k: _items(v) for k, v in kwargs.items()})

    return _Direct()
