"""Ranks that disagree, on this process's rank of a torchrun group: each case builds a run in which
rank 1 differs from the others (its data's values, labels or sizes, a setting, its initial model, a
batch stream it advanced once more), catches the ``RankMismatch`` every rank raises, and records the
message; a case where the ranks agree records none. Also: the merge's chunked sum against the sum in
rank order of every rank's tensors, and a round whose aggregate overflows.

``python tests/ranks_agree_child.py OUT_DIR``: each rank writes ``OUT_DIR/rank<r>.json``;
tests/test_sim_rank_agreement.py starts it under torchrun and reads them.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch

from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.federated_data import build_federated_data
from fedopt_kernels.sim.models.build import build_model
from fedopt_kernels.sim.ranks import RankMismatch, Ranks
from fedopt_kernels.sim.resume import tensor_digest
from fedopt_kernels.sim.simulation import Simulation

SIZES = [0, 1, 7, 65, 3]  # odd sizes, an empty tensor


def config(**kw: Any) -> SimConfig:
    base: Dict[str, Any] = dict(
        algorithm="fedavg",
        dataset="synthetic",
        model="mlp",
        hidden=8,
        clients=9,
        holdout_fraction=0.25,
        clients_per_round=4,
        rounds=2,
        local_steps=2,
        batch_size=4,
        finetune_steps=0,
        device="cpu",
        backend="reference",
    )
    base.update(kw)
    return SimConfig(**base)


def data(cfg: SimConfig):
    ss_data = np.random.SeedSequence(cfg.seed).spawn(5)[0]
    return build_federated_data(cfg, np.random.default_rng(ss_data), torch.device("cpu"))


def changed(kind: str):
    """Rank 1's data, differing from the others' by ``kind``."""
    d = data(config())
    c = d.train_clients[2]
    if kind == "values":
        c.train_x[0, 0] += 1.0
    elif kind == "labels":
        c.train_y[0] = (c.train_y[0] + 1) % d.num_classes
    elif kind == "sizes":
        d.train_clients[2] = dataclasses.replace(c, train_x=c.train_x[:-1], train_y=c.train_y[:-1])
    return d


def model(cfg: SimConfig, odd: bool) -> torch.nn.Module:
    """The run's model; on rank 1 one weight differs."""
    d = data(cfg)
    m = build_model(cfg.model, d.input_shape, d.num_classes, d.input_spec, cfg.hidden, cfg.context)
    if odd:
        with torch.no_grad():
            next(m.parameters()).view(-1)[0] += 1.0
    return m


def run_case(ranks: Ranks, case: str, folder: Path) -> Dict[str, Any]:
    odd = ranks.rank == 1
    cfg, kw = config(), {}
    if case in ("values", "labels", "sizes"):
        kw["data"] = changed(case) if odd else data(cfg)
    elif case == "settings" and odd:
        cfg = config(finetune_lr=0.02)
    elif case == "model":
        kw["model_fn"] = lambda: model(cfg, odd)
    elif case == "overflow":
        cfg = config(algorithm="padamfed", rounds=2, client_batched=2)
    try:
        sim = Simulation(cfg, ranks=ranks, client_state_dir=folder / f"store-{case}", **kw)
        if case == "streams" and odd:
            sim.streams[5].skip(1)  # one batch more than the others drew: each rank advances every stream
        if case == "overflow":
            finish = sim.strategy.finish

            def huge(cid: int, opt: Any, t: int) -> Any:
                u = finish(cid, opt, t)
                if t == 1:
                    u.delta = [torch.full_like(x, 3e38) for x in u.delta]
                return u

            sim.strategy.finish = huge  # type: ignore[method-assign]
        result = sim.run()
        return {
            "mismatch": None,
            "refused": [r.get("refused") for r in result["history"]],
            "model": tensor_digest(sim.global_params),
        }
    except RankMismatch as exc:
        return {"mismatch": str(exc)}


def chunked_sum(ranks: Ranks) -> List[bool]:
    """The merge's sum against ``p_0 + p_1 + ...`` added here in rank order, bit for bit, for
    float64 and float32 tensors of odd sizes (fewer numbers than ranks included)."""
    import torch.distributed as dist

    out = []
    for sizes in (SIZES, [1], [2], []):

        def inputs(r: int, sizes: List[int] = sizes) -> List[torch.Tensor]:
            g = torch.Generator().manual_seed(100 * r + len(sizes))
            ts = []
            for i, n in enumerate(sizes):
                dtype = torch.float64 if i % 2 == 0 else torch.float32
                ts.append((torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** (3 * r)).to(dtype))
            return ts

        mine = inputs(ranks.rank)
        ranks._sum_in_rank_order(mine)
        want = inputs(0)
        for r in range(1, ranks.world):
            for w, p in zip(want, inputs(r), strict=True):
                w.add_(p)
        out.append(all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(mine, want, strict=True)))
    dist.barrier()
    return out


def main() -> int:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    ranks = Ranks.from_environment("cpu")
    record: Dict[str, Any] = {"sum": chunked_sum(ranks)}
    for case in ("agree", "values", "labels", "sizes", "settings", "model", "streams", "overflow"):
        record[case] = run_case(ranks, case, out)
        ranks.barrier()
    (out / f"rank{ranks.rank}.json").write_text(json.dumps(record))
    ranks.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
