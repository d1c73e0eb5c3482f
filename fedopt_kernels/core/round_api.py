"""The round API every optimizer has (docs/algorithms.md, section 1): ``start_round`` and the counters.

``start_round(**round_inputs)`` is what a client calls when it receives the global model: the
within-round step counter ``k`` back to 0, per-round state (momentum buffers) cleared unless
``reset_state=False``, the FedProx anchor ``x0`` taken, the SCAFFOLD correction stored, and the
algorithm's own round inputs checked (``_check_round_inputs``) and stored (``_apply_round_inputs``).
Everything is checked before anything changes.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .checks import check_tensor_list
from .gather import PlanGather


class RoundAPI(PlanGather):
    """``start_round``, ``round_index`` (t) and ``round_step`` (k)."""

    @property
    def round_index(self) -> int:
        """t: the number of start_round calls so far, minus one."""
        return self._t

    @property
    def round_step(self) -> int:
        """k: the number of steps taken since the last start_round (reads the device counter)."""
        return int(self._k_dev.reshape(-1)[0]) if self._k_dev is not None else self._k_host

    @torch.no_grad()
    def start_round(
        self,
        *,
        reset_state: bool = True,
        correction: Optional[Sequence[torch.Tensor]] = None,
        round_index: Any = None,
        **inputs: Any,
    ) -> None:
        """Begin local training on a freshly received global model (docs/algorithms.md).

        Resets the within-round step counter, clears per-round state (momentum buffers, ...)
        unless ``reset_state=False``, snapshots the FedProx anchor ``x0`` for groups with
        ``prox_mu > 0``, and stores the SCAFFOLD ``correction`` (``c - c_i``, one tensor per
        parameter in param-group order) that is added to every gradient of the round.
        ``round_index``: the index t of the round this one is (default: the one after the last);
        one optimizer can then train client after client, each at the global round.
        """
        if round_index is not None and (
            isinstance(round_index, bool) or not isinstance(round_index, int) or round_index < 0
        ):
            raise ValueError(f"round_index must be an integer >= 0, got {round_index!r}")
        params = self._params_flat
        if correction is not None:
            if not self._accepts_correction:
                raise TypeError(f"{type(self).__name__}.start_round() takes no 'correction'")
            correction = check_tensor_list("correction", correction, params, self._name_of)
        inputs = self._check_round_inputs(inputs)
        self._check_graph_round()
        # everything validated: from here on nothing raises
        self._retire_graph()
        self._t = self._t + 1 if round_index is None else round_index
        self._k_host = 0
        self._host_steps = 0
        if self._k_dev is not None:
            self._k_dev.zero_()
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)  # never create an empty entry (torch keeps none)
                if st is not None:
                    if reset_state:
                        for key in self._round_state:
                            st.pop(key, None)
                    st.pop("correction", None)
                    st.pop("x0", None)
                    if not st:
                        del self.state[p]
                if group.get("prox_mu", 0.0) != 0.0:
                    self.state[p]["x0"] = p.detach().clone(memory_format=torch.preserve_format)
        if correction is not None:
            for p, c in zip(params, correction, strict=True):
                self.state[p]["correction"] = c.detach().to(dtype=p.dtype).clone()
        self._apply_round_inputs(inputs)
        self._plan = None
