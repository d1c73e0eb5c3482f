"""Reference client-batched ops (docs/client_batched.md): the per-client reference step, client by client.

Client ``c`` of a batched op runs exactly the per-client op on the ``c``-th slices of every
tensor, its own hp rows ``hp[:, c]`` and its own counter ``k[c]``; inactive clients are skipped
(nothing of theirs changes). That is docs/client_batched.md's definition, which the fused batched kernels are
tested against. For ``sgd_batched``, a client at ``k == 0`` in a round whose momentum buffers are
new (the ``FRESH`` bit) takes the first-step rule ``buf = d``: its rows get ``dampening = 0``,
which is how the per-client op's first step is formed.
"""

from __future__ import annotations

from ..impl_table import register, registered
from ..ops import BATCHED, FRESH, PER_CLIENT, OpArgs


def _per_client(name: str):
    spec = BATCHED[name]
    base = PER_CLIENT[spec.base]

    def step(*args, cache=None) -> None:
        a = OpArgs.parse(spec, args)
        fn = registered(base.name, "reference")
        active = None if a.active is None else a.active.tolist()
        ks = a.k.tolist()
        damp = base.hps.index("dampening") if "dampening" in base.hps else None
        present = [m & ~FRESH for m in a.present]
        for c in range(a.hp.shape[1]):
            if active is not None and not active[c]:
                continue
            hp = a.hp[:, c, :].clone()
            if damp is not None and ks[c] == 0:
                for b, m in enumerate(a.present):
                    if m & FRESH:
                        hp[b, damp] = 0.0
            lists = [[t[c] for t in a.lists[r.name]] for r in spec.roles]
            fn(
                *lists,
                a.row_of,
                present,
                hp,
                a.k[c : c + 1],
                a.table,
                a.decay_every,
                a.grad_scale,
                a.found_inf,
                "reference",
            )

    step.__name__ = step.__qualname__ = f"{name}_reference"
    return register(name, "reference")(step)


for _name in BATCHED:
    _per_client(_name)
