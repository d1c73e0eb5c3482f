"""Ranks that check what they agree on (fedopt_kernels.sim.rank_round, ranks): one torchrun launch of
three processes on this machine's CPU (gloo), tests/ranks_agree_child.py on each.

At the start the ranks compare their settings, clients' sizes, data and initial model; a rank given
other data values, labels or sizes, another setting or another model stops the run on every rank
with a ``RankMismatch`` naming the rank and what differs. The periodic check compares each rank's
own draws (sampling, batch streams) besides the merged model: a rank that drew one batch more is
found. The merge sums in chunks, bit for bit the rank-order sum; a round whose aggregate overflows
is refused on every rank alike.
"""

import json

import pytest
from test_sim_ranks import HERE, _torchrun, needs_torchrun

WORLD = 3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("agree")
    _torchrun(["--standalone", str(HERE / "ranks_agree_child.py"), str(out)], out, nproc=WORLD)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@needs_torchrun
def test_the_chunked_merge_is_the_sum_in_rank_order_bit_for_bit(ranks):
    assert all(r["sum"] == [True] * 4 for r in ranks)


@needs_torchrun
def test_ranks_that_agree_run_to_the_end(ranks):
    assert all(r["agree"]["mismatch"] is None for r in ranks)
    assert len({r["agree"]["model"] for r in ranks}) == 1


@needs_torchrun
@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("values", "rank 1 differs from rank 0 in data (every client's samples and labels)"),
        ("labels", "rank 1 differs from rank 0 in data (every client's samples and labels)"),
        ("sizes", "rank 1 differs from rank 0 in client sizes (first at index 2: "),
        ("settings", "rank 1 differs from rank 0 in settings (finetune_lr: 0.01 on rank 0, 0.02 there)"),
        ("model", "rank 1 differs from rank 0 in the initial model"),
    ],
)
def test_a_rank_with_other_data_settings_or_model_stops_the_run_at_the_start(ranks, case, named):
    for r in ranks:  # every rank stops, with the same message
        why = r[case]["mismatch"]
        assert why is not None and why.startswith("the ranks of this run disagree at the start: "), why
        assert named in why, why
        assert "rank 2" not in why  # only the rank that differs is named
    if case in ("values", "labels"):
        assert "client sizes" not in ranks[0][case]["mismatch"]


@needs_torchrun
def test_a_rank_whose_own_draws_went_another_way_is_found_by_the_periodic_check(ranks):
    for r in ranks:
        why = r["streams"]["mismatch"]
        assert why is not None
        assert "disagree after round 2: rank 1 differs from rank 0 in the clients' batch streams" in why
        assert "the global model" not in why  # the merged model still agrees: only the draws tell


@needs_torchrun
def test_an_overflowing_round_is_refused_on_every_rank(ranks):
    for r in ranks:
        assert r["overflow"]["mismatch"] is None
        assert r["overflow"]["refused"][0] is None
        assert r["overflow"]["refused"][1].startswith("the aggregate is not finite (inf or NaN: model[0]")
    assert len({r["overflow"]["model"] for r in ranks}) == 1
