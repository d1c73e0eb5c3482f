"""experiments/paper_commands.py: the papers' own commands parse as fedopt-sim takes them, the
results page shows them as the script prints them, and the timing slice runs (a CPU smoke slice)."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("paper_commands", ROOT / "experiments" / "paper_commands.py")
assert spec is not None and spec.loader is not None
pc = importlib.util.module_from_spec(spec)
sys.modules["paper_commands"] = pc
spec.loader.exec_module(pc)

COMMANDS = [line for line in pc.print_commands().splitlines() if line.startswith("fedopt-sim ")]


def test_every_command_is_one_fedopt_sim_accepts():
    from fedopt_kernels.sim.cli.fedopt_sim import build_parser, config_from_args

    assert len(COMMANDS) == sum(len(m) + len(b) for *_, m, b in pc.PAPERS)
    for line in COMMANDS:
        args = build_parser().parse_args(shlex.split(line)[1:])
        for seed in args.seeds:
            cfg = config_from_args(args, seed)  # the config validates every setting's range
            assert cfg.seed == seed and cfg.device == "cuda" and cfg.client_batched > 1


def test_grids_are_equal_and_the_baseline_lrs_cover_the_methods():
    for name, _, _, method, baseline in pc.PAPERS:
        assert len(method) == len(baseline), name
        lr = lambda own: float(re.search(r"--lr (\S+)", own).group(1))  # noqa: E731
        m, b = {lr(o) for _, o in method}, {lr(o) for _, o in baseline}
        assert min(b) <= min(m) and max(m) <= max(b) and (m <= b or name == "fednar"), name


def test_the_results_page_shows_the_commands_the_script_prints():
    page = (ROOT / "experiments" / "results_real.md").read_text()
    shown = [line for line in page.splitlines() if line.startswith("fedopt-sim ")]
    assert shown and set(shown) <= set(COMMANDS)


def test_a_smoke_slice_times_every_paper(tmp_path):
    pc.main(["--time", "--device", "cpu", "--smoke", "--slice-rounds", "2", "--out-dir", str(tmp_path)])
    res = json.loads((tmp_path / "paper-commands-cpu.json").read_text())
    assert set(res["papers"]) == {name for name, *_ in pc.PAPERS}
    for paper in res["papers"].values():
        for row in paper["rows"].values():
            assert (
                row["rounds_timed"] == 2 and row["round_s"] > 0 and row["estimate_s"] > row["rounds"] * row["round_s"]
            )
            assert row["config"]["clients_per_round"] == 2  # the smoke slice shrank it
        assert paper["rows"]["method, sequential"]["engine"] == "sequential"
        assert paper["rows"]["method"]["engine"].startswith("client-batched")
    assert (tmp_path / "paper-commands-cpu.md").read_text().startswith("## The papers' commands")


def test_one_papers_slices_alone(tmp_path):
    pc.main(
        ["--time", "--device", "cpu", "--smoke", "--slice-rounds", "1", "--paper", "fednlr", "--no-sequential"]
        + ["--out-dir", str(tmp_path)]
    )
    res = json.loads((tmp_path / "paper-commands-cpu.json").read_text())
    assert list(res["papers"]) == ["fednlr"] and set(res["papers"]["fednlr"]["rows"]) == {"method", "baseline"}


@pytest.mark.parametrize(
    "argv", [[], ["--print", "--time"], ["--time", "--slice-rounds", "0"], ["--time", "--paper", "fedsomething"]]
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        pc.main(argv)


def test_an_interrupted_timing_writes_the_slices_it_has(tmp_path, monkeypatch):
    from interrupt import interrupt_on_call

    monkeypatch.setattr(pc, "time_slice", interrupt_on_call(pc.time_slice, 2))
    pc.main(
        ["--time", "--device", "cpu", "--smoke", "--slice-rounds", "1", "--no-sequential", "--out-dir", str(tmp_path)]
    )
    res = json.loads((tmp_path / "paper-commands-cpu.json").read_text())
    assert res["interrupted"] and list(res["papers"]) == ["fednar"]
    assert list(res["papers"]["fednar"]["rows"]) == ["method"]
    assert "**Interrupted**" in (tmp_path / "paper-commands-cpu.md").read_text()


def test_a_killed_timing_writes_the_slices_it_has(tmp_path, monkeypatch):
    """kill (SIGTERM) keeps the slices timed so far, as gpu_check's SIGINT does."""
    import signal

    from interrupt import kill_on_call, sigterm_guard

    monkeypatch.setattr(pc, "time_slice", kill_on_call(pc.time_slice, 2))
    with sigterm_guard() as outside:
        pc.main(
            ["--time", "--device", "cpu", "--smoke", "--slice-rounds", "1", "--no-sequential"]
            + ["--out-dir", str(tmp_path)]
        )
        assert signal.getsignal(signal.SIGTERM) is outside
    res = json.loads((tmp_path / "paper-commands-cpu.json").read_text())
    assert res["interrupted"] and list(res["papers"]["fednar"]["rows"]) == ["method"]
