"""The last check of a round's server side: a new global model or server state that is not finite
(inf or NaN) is refused, and the round leaves the model and server state as they were.

Every accepted update is finite (``screen.py``), but their weighted mean need not be: updates of
3e38 each are finite floats whose sum overflows float32. The round's record names what was refused
(``refused``), as a client left out is named in ``left_out``. The check reads one flag per tensor
from the device once a round; on several processes every rank computes the same result from the
same merged sums, so every rank refuses the same round.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

Tensors = List[torch.Tensor]


def not_finite(new: Dict[str, Tensors]) -> Optional[str]:
    """None when every tensor of ``new`` (``"x"``: the new global model; the others: the server
    state's tensors, by name) is finite; else why the round is refused, naming the tensors."""
    named = [(key, i, t) for key in new for i, t in enumerate(new[key]) if t.is_floating_point()]
    if not named:
        return None
    finite = torch.stack([torch.isfinite(t).all() for _, _, t in named]).tolist()  # one read from the device
    bad = [(key, i) for (key, i, _), ok in zip(named, finite, strict=True) if not ok]
    if not bad:
        return None
    listed = ", ".join(("model" if key == "x" else key) + f"[{i}]" for key, i in bad)
    return (
        f"the aggregate is not finite (inf or NaN: {listed}), e.g. finite updates whose weighted mean "
        f"overflows; the round's new model and server state are refused, the previous ones kept"
    )
