"""``python -m bench scale``: its rows, one real measured run, and the report (bench/scale.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import scale  # noqa: E402


def test_the_plan_has_fedavg_beside_every_keeping_algorithm(tmp_path):
    rows = scale.plan(["clients", "population", "setup"], tmp_path, big=2000)
    parts = {p for p, _, _ in rows}
    assert parts == {"clients", "population", "setup"}
    for part, labels, argv in rows:
        assert "--client-state-dir" in argv and argv[argv.index("--algorithm") + 1] == labels["algorithm"]
        if labels["algorithm"] != "fedavg":
            twin = [r for r in rows if r[0] == part and r[1]["algorithm"] == "fedavg" and r[1]["N"] == labels["N"]]
            assert twin, (part, labels)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="RssAnon is read from /proc")
def test_a_measured_run_reports_its_peak_and_phases(tmp_path):
    argv = [*scale.SYNTHETIC, "--algorithm", "scaffold", "--clients", "20", "--clients-per-round", "4"]
    argv += ["--rounds", "2", "--finetune-steps", "0", "--client-state-dir", str(tmp_path)]
    row = scale.measure(argv, timeout=300)
    assert "error" not in row, row
    assert row["peak_rss_anon"] > 10**7 and row["setup_s"] > 0 and len(row["round_s"]) == 2
    assert row["store_bytes"] > 0 and row["trained_at_once"] == 1
    result = {
        "meta": {"device_name": "cpu", "date": "d", "command": "c", "commit": "x", "torch": "t"},
        "rows": [
            {
                "part": "population",
                "labels": {"algorithm": "scaffold", "clients at once": "1", "per round": 4, "N": 20},
                **row,
            }
        ],
    }
    text = scale.markdown(result)
    assert "| population | scaffold | 20 | 4 | 1 (1) |" in text
    drawn = scale.chart(result, tmp_path / "c.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not drawn
    else:
        assert drawn and (tmp_path / "c.png").stat().st_size > 0
