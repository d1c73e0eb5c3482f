"""state_dict round trip in the middle of a round: save, load into a fresh optimizer, continue —
bit-identical to the uninterrupted run, on every available backend."""

import pytest
import torch
from harness import ALGOS, backend_skip_reason, run_case

from fedopt_kernels.core import registry as _registry


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("algo,option", [(a, o) for a in ALGOS for o in ALGOS[a].options])
@pytest.mark.parametrize("backend", _registry.BACKENDS)
def test_mid_round_round_trip_is_bit_identical(backend, algo, option, dtype):
    why = backend_skip_reason(backend)
    if why:
        pytest.skip(why)
    full = run_case(algo, option, "odd", dtype, backend)
    half = run_case(algo, option, "odd", dtype, backend, snapshot=(1, 0))
    # through torch.save/load, as a checkpoint would go
    import io

    buf = io.BytesIO()
    torch.save({"params": half.params, "state_dict": half.state_dict}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    rest = run_case(algo, option, "odd", dtype, backend, load_from=saved, start_at=(1, 1))
    for i, (a, b) in enumerate(zip(full.params, rest.params)):
        assert torch.equal(a, b), f"parameter {i} differs after a mid-round state_dict round trip"
    for i, (sa, sb) in enumerate(zip(full.state, rest.state)):
        assert sorted(sa) == sorted(sb)
        for key in sa:
            assert sa[key].dtype == sb[key].dtype, f"state {key} dtype changed by the round trip"
            assert torch.equal(sa[key], sb[key]), f"state {key} of parameter {i} differs"


def test_round_counters_are_saved():
    import fedopt_kernels as fk

    p = torch.nn.Parameter(torch.zeros(3))
    opt = fk.FedNAR([p], lr=0.1, weight_decay=0.0, backend="reference")
    for _ in range(3):
        opt.start_round()
    p.grad = torch.ones(3)
    opt.step()
    opt.step()
    sd = opt.state_dict()
    fresh = fk.FedNAR([p], lr=0.1, weight_decay=0.0, backend="reference")
    fresh.load_state_dict(sd)
    assert (fresh.round_index, fresh.round_step) == (2, 2)
    with pytest.raises(ValueError, match="fedopt_round"):
        fresh.load_state_dict(torch.optim.SGD([p], lr=0.1).state_dict())
