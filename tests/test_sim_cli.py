"""fedopt-sim end to end: --validate on every available backend, determinism, output files, bad input."""

import argparse
import json
import math
import re

import pytest
import torch

import fedopt_kernels
from fedopt_kernels.sim.cli import fedopt_sim
from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.simulation import Simulation
from fedopt_kernels.sim.validate import Validation

SHORT = [
    "--clients",
    "10",
    "--rounds",
    "2",
    "--local-steps",
    "2",
    "--clients-per-round",
    "2",
    "--finetune-steps",
    "1",
    "--quiet",
    "--no-files",
]
# one algorithm per op and option: sgd, sgd + neuron scales, fednar + correction, padamfed with anchor grads
VALIDATE_ALGORITHMS = ["fedavg", "fednlr", "fednar-scaffold", "padamfed-vr"]


# the simulator's tiny models: one torch thread (conftest.py), as fedopt-sim's --threads default
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("backend", list(fedopt_kernels.available_backends()))
@pytest.mark.parametrize("algorithm", VALIDATE_ALGORITHMS)
def test_validate_every_available_backend(backend, algorithm, capsys):
    # not --quiet: a passing validation then prints its per-round table too, which this test reads
    loud = [a for a in SHORT if a != "--quiet"]
    status = fedopt_sim.main(loud + ["--algorithm", algorithm, "--validate", backend])
    out = capsys.readouterr().out
    assert "PASS" in out, out
    assert status == 0
    assert out.count("e-") + out.count("e+") >= 2 * 2  # a divergence line per round


def test_validate_auto_picks_the_auto_backend(capsys):
    assert fedopt_sim.main(SHORT + ["--validate", "auto", "--rounds", "1", "--device", "cpu"]) == 0
    want = "cpu" if "cpu" in fedopt_kernels.available_backends("cpu") else "reference"
    assert f"reference vs {want}" in capsys.readouterr().out


def _round(rel, traj=0.0):
    return {"round": 1, "step_max_abs": rel, "step_rel": rel, "traj_max_abs": traj, "traj_rel": traj}


def test_validate_fails_past_tolerance(monkeypatch, capsys):
    bad = Validation(backend="reference", rounds=[_round(0.5)], acc_diff={"x": 0.0})
    monkeypatch.setattr("fedopt_kernels.sim.validate.validate_backend", lambda *a, **k: bad)
    assert fedopt_sim.main(SHORT + ["--validate", "reference"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_validation_verdicts():
    assert Validation("x", rounds=[_round(1e-6, traj=0.5)], acc_diff={"a": 0.001}).passed  # trajectory: info only
    assert not Validation("x", rounds=[_round(float("nan"))]).passed
    assert not Validation("x", acc_diff={"a": float("nan")}).passed
    assert not Validation("x", acc_diff={"a": 0.02}).passed
    assert math.isnan(Validation("x", rounds=[_round(0.0), _round(float("nan"))]).max_rel)


def _fake_cpu_backend(monkeypatch, perturb):
    """Register reference-sgd-plus-``perturb`` as the "cpu" backend for this test only."""
    from fedopt_kernels.core import registry as _registry
    from fedopt_kernels.core.reference import sgd_step

    def fake(*args, cache=None):
        sgd_step(*args)
        with torch.no_grad():
            for x in args[0]:  # the op's params list
                perturb(x)

    monkeypatch.setitem(_registry._LOAD_ERRORS, "cpu", None)
    monkeypatch.setitem(_registry.DEVICE_OK, "cpu", lambda device: None)
    monkeypatch.setitem(_registry.IMPLS["sgd"], "cpu", fake)


def test_validate_passes_rounding_noise(monkeypatch, capsys):
    # one ulp on every parameter after every step: what a correct fused kernel may differ by
    _fake_cpu_backend(monkeypatch, lambda x: x.copy_(torch.nextafter(x, torch.full_like(x, math.inf))))
    assert fedopt_sim.main(SHORT + ["--validate", "cpu", "--rounds", "3"]) == 0, capsys.readouterr().out


def test_validate_catches_a_wrong_kernel(monkeypatch, capsys):
    # a kernel that forgets part of the update: here an extra 1e-4 shrink per step
    _fake_cpu_backend(monkeypatch, lambda x: x.mul_(1 - 1e-4))
    assert fedopt_sim.main(SHORT + ["--validate", "cpu", "--rounds", "3"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_run_is_deterministic_from_its_seed():
    cfg = SimConfig(
        algorithm="scaffold",
        clients=10,
        rounds=3,
        local_steps=3,
        clients_per_round=3,
        backend="reference",
        finetune_steps=2,
    )
    a, b = Simulation(cfg).run(), Simulation(cfg).run()
    c = Simulation(cfg.replace(seed=1)).run()

    def strip(r):
        return ([{k: v for k, v in h.items() if k != "seconds"} for h in r["history"]], r["final"])

    assert strip(a) == strip(b)
    assert strip(a) != strip(c)


def test_files_and_table(tmp_path, capsys):
    out = tmp_path / "run"
    status = fedopt_sim.main(
        [
            "--clients",
            "10",
            "--rounds",
            "2",
            "--local-steps",
            "2",
            "--quiet",
            "--seeds",
            "0",
            "1",
            "--algorithm",
            "feddecay",
            "--beta",
            "0.5",
            "--backend",
            "reference",
            "--out",
            str(out),
        ]
    )
    assert status == 0
    text = capsys.readouterr().out
    assert "fine-tuned new bottom10%" in text and "±" in text
    for seed in (0, 1):
        result = json.loads((out / f"metrics_seed{seed}.json").read_text())
        assert result["config"]["seed"] == seed and result["hparams"]["beta"] == 0.5
        assert len(result["history"]) == 2 and "val_acc" in result["history"][-1]
        assert set(result["final"]["finetuned"]) == {"existing", "new"}
        lines = (out / f"metrics_seed{seed}.csv").read_text().splitlines()
        assert lines[0].startswith("round,train_loss") and len(lines) == 3
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "args,names",
    [
        (["--algorithm", "fedmagic"], "--algorithm"),
        (["--dirichlet-alpha", "0"], "--dirichlet-alpha"),
        (["--alpha", "-1"], "--dirichlet-alpha"),
        (["--clients", "10", "--clients-per-round", "9"], "--clients-per-round"),
        (["--sample-rate", "0"], "--sample-rate"),
        (["--rounds", "0"], "--rounds"),
        (["--lr", "-0.1"], "--lr"),
        (["--algorithm", "fedavg", "--beta", "0.5"], "--beta"),
        (["--algorithm", "feddecay", "--beta", "1.5"], "--beta"),
        (["--algorithm", "fedavg", "--prox-mu", "0.1"], "--prox-mu"),
        (["--dataset", "synthetic", "--model", "cnn"], "cnn"),
        (["--clients", "5000"], "--clients"),
        (["--backend", "nope"], "--backend"),
        (["--validate", "nope"], "--validate 'nope'"),
        (["--seeds", "1", "1"], "--seeds"),
        (["--split", "0", "0.5", "0.5"], "--split"),
        (["--dataset", "mnist"], "--data-dir"),
    ],
)
def test_bad_input_names_the_parameter(args, names, capsys):
    with pytest.raises(SystemExit) as exc:
        fedopt_sim.main(SHORT + args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert names in err, err


def test_an_error_names_the_option_as_typed():
    with pytest.raises(SystemExit):
        fedopt_sim.main(SHORT + ["--rounds=-1"])
    # the settings name the field (the Python API's word); the command line names its option
    assert (
        fedopt_sim.name_flags("rounds must be an integer >= 1, got -1", fedopt_sim.build_parser())
        == "--rounds must be an integer >= 1, got -1"
    )


def _numeric_options():
    # a list: pytest deprecates parametrizing over a one-shot iterator
    return [
        pytest.param(action, id=action.option_strings[-1])
        for action in fedopt_sim.build_parser()._actions
        if action.option_strings and action.type in (int, float)
    ]


@pytest.mark.parametrize("action", _numeric_options())
def test_every_numeric_option_out_of_range_is_named_by_its_flag(action, capsys):
    """-5 for every integer option, NaN for every real one: each is refused (exit 2) with its flag,
    and the field name behind it (``clients_per_round``) does not appear on its own."""
    value = "-5" if action.type is int else "nan"
    given = (
        [f"{action.option_strings[-1]}={value}"]
        if action.nargs in (None, "+")
        else [action.option_strings[-1]] + [value] * action.nargs
    )
    with pytest.raises(SystemExit) as exc:
        fedopt_sim.main(SHORT + given)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedopt-sim: error: ") and len(err.splitlines()) == 1, err
    flag = next(o for o in action.option_strings if o.startswith("--"))
    assert flag in err, err
    assert not re.search(rf"(?<![\w-]){action.dest}(?![\w-])", err.replace(flag, "")), err


def test_help_lists_every_data_set_read_from_data_dir(capsys):
    from fedopt_kernels.sim.config import FOLDER_DATASETS

    parser = fedopt_sim.build_parser()
    data_dir = next(a for a in parser._actions if "--data-dir" in a.option_strings)
    for text in (parser.description, data_dir.help):
        named = set(re.findall(r"[\w-]+", text))
        assert set(FOLDER_DATASETS) <= named, (sorted(set(FOLDER_DATASETS) - named), text)
    with pytest.raises(SystemExit):
        fedopt_sim.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert " ".join(parser.description.split()) in shown


def test_quiet_hides_the_bar_not_the_timing_line(capsys):
    assert fedopt_sim.main(SHORT + ["--algorithm", "fedavg", "--backend", "reference"]) == 0  # SHORT has --quiet
    err = capsys.readouterr().err
    assert re.search(r"^seed 0: 2 rounds in \d+\.\d s \(backend reference, device cpu\)$", err, re.M), err


def test_client_batched_says_when_it_trains_another_number_of_clients(capsys):
    """--client-batched 10 with 2 clients sampled per round trains 2 at once, and says so."""
    assert fedopt_sim.main(SHORT + ["--algorithm", "fedavg", "--client-batched", "10"]) == 0
    err = capsys.readouterr().err
    assert "seed 0: --client-batched 10 trains 2 clients at once (all 2 sampled clients of a round)" in err, err
    assert fedopt_sim.main(SHORT + ["--algorithm", "fedavg", "--client-batched", "2"]) == 0
    assert "--client-batched 2 trains" not in capsys.readouterr().err


def test_client_batched_verdict_line_says_why_its_count_differs(capsys):
    """The PASS line of --validate sequential, the only line --quiet leaves, explains its own client count."""
    for asked in ("10", "2"):
        assert fedopt_sim.main(SHORT + ["--client-batched", asked, "--validate", "sequential"]) == 0
    verdicts = [ln for ln in capsys.readouterr().out.splitlines() if "PASS" in ln]
    assert len(verdicts) == 2, verdicts
    assert "client-batched 2 [" in verdicts[0], verdicts[0]
    assert "seed 0; --client-batched 10, but a round samples 2 clients)" in verdicts[0], verdicts[0]
    assert "--client-batched" not in verdicts[1], verdicts[1]  # asked for 2, and 2 it is


# an option's earlier spelling -> (its name today, its value, the other options it needs): the earlier
# spelling still works and says it is deprecated
RENAMED_OPTIONS = {
    "--client-parallel": ("--client-batched", ["4"], []),
    "--cuda-graph": ("--replay", [], ["--client-batched", "2"]),
}


@pytest.mark.parametrize("earlier", list(RENAMED_OPTIONS))
def test_an_earlier_option_name_works_and_says_once_what_to_use(earlier, capsys):
    name, value, needs = RENAMED_OPTIONS[earlier]
    parser = fedopt_sim.build_parser()
    new = parser.parse_args(SHORT + needs + [name, *value])
    assert capsys.readouterr().err == ""
    old = fedopt_sim.build_parser().parse_args(SHORT + needs + [earlier, *value, earlier, *value])
    err = capsys.readouterr().err
    assert err.count("deprecated") == 1 and f"{earlier} is deprecated, use {name}" in err, err
    assert fedopt_sim.config_from_args(old, 0) == fedopt_sim.config_from_args(new, 0)
    without = parser.parse_args(SHORT + needs)
    assert fedopt_sim.config_from_args(new, 0) != fedopt_sim.config_from_args(without, 0)


def test_a_resumed_run_reports_the_rounds_it_ran(tmp_path, monkeypatch, capsys):
    args = [
        "--clients",
        "10",
        "--rounds",
        "3",
        "--local-steps",
        "1",
        "--clients-per-round",
        "2",
        "--finetune-steps",
        "1",
        "--quiet",
        "--algorithm",
        "fedavg",
        "--checkpoint-every",
        "1",
        "--out",
        str(tmp_path / "run"),
    ]
    real = Simulation.run_round

    def stop_at_round_2(self, t):
        if t == 1:
            raise KeyboardInterrupt  # stopped after round 1 (checkpointed)
        return real(self, t)

    monkeypatch.setattr(Simulation, "run_round", stop_at_round_2)
    with pytest.raises(KeyboardInterrupt):
        fedopt_sim.main(args)
    monkeypatch.setattr(Simulation, "run_round", real)
    capsys.readouterr()
    assert fedopt_sim.main(args + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"^seed 0: 2 rounds \(2-3, resumed\) in \d+\.\d s", err, re.M), err


# --threads on the client-batched path stands for both paths: the sequential one sets the same count
@pytest.mark.parametrize(
    "extra, want", [([], 1), (["--client-batched", "2"], 1), (["--client-batched", "2", "--threads", "2"], 2)]
)
def test_threads_default_is_one_on_both_paths(extra, want):
    """One thread whether clients train one after another or at once: with torch's default, a
    client-batched run slowed down several times over once another process took a core; --threads wins."""
    torch.set_num_threads(3)  # stands for torch's default; the module fixture restores the thread count
    assert fedopt_sim.main(SHORT + ["--algorithm", "fedavg", "--rounds", "1", "--local-steps", "1"] + extra) == 0
    assert torch.get_num_threads() == want
    torch.set_num_threads(1)


@pytest.mark.parametrize("option", ["--backend", "--validate"])
def test_triton_on_the_cpu_is_refused_unless_the_interpreter_is_asked_for(option, monkeypatch, capsys):
    """Triton on CPU tensors runs its interpreter (many times slower than cpu): never by surprise."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exc:
        fedopt_sim.main(SHORT + [option, "triton", "--device", "cpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedopt-sim: error:") and len(err.splitlines()) == 1, err
    assert option.lstrip("-") in err and "TRITON_INTERPRET=1" in err and "cpu" in err, err
    # TRITON_INTERPRET=1 in the environment is the explicit request: nothing to refuse
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fedopt_sim._prepare_environment(fedopt_sim.build_parser().parse_args(SHORT + [option, "triton", "--device", "cpu"]))


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def test_help_shows_every_default(capsys):
    parser = fedopt_sim.build_parser()
    with pytest.raises(SystemExit):
        fedopt_sim.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    fmt = parser._get_formatter()
    fmt.add_arguments(parser._actions)  # the same column layout as the whole --help
    missing = []
    for action in parser._actions:
        flag = isinstance(action, argparse._StoreTrueAction) and action.default is False  # off unless given
        if not action.option_strings or action.default in (None, argparse.SUPPRESS) or flag:
            continue
        own = " ".join(fmt._format_action(action).split())  # the option's lines of --help
        if "default" not in own or _shown(action.default) not in own or own not in text:
            missing.append(f"{action.option_strings[0]} (default {_shown(action.default)}): {own!r}")
    assert not missing, "--help does not show these defaults:\n" + "\n".join(missing)


FILES = [
    "--clients",
    "10",
    "--rounds",
    "1",
    "--local-steps",
    "1",
    "--clients-per-round",
    "2",
    "--finetune-steps",
    "1",
    "--quiet",
    "--backend",
    "reference",
    "--algorithm",
    "fedavg",
]


def _snapshot(folder):
    """Every file under ``folder`` (its checkpoints/ subfolder included), by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_run_never_replaces_an_earlier_runs_files(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    first = tmp_path / "sim_runs" / "fedavg-digits"
    assert fedopt_sim.main(FILES) == 0
    kept = _snapshot(first)
    assert "metrics_seed0.json" in kept
    # no --out: the next free numbered folder, and the output says which
    assert fedopt_sim.main(FILES + ["--seeds", "1"]) == 0
    second = tmp_path / "sim_runs" / "fedavg-digits-2"
    assert (second / "metrics_seed1.json").is_file()
    assert "sim_runs/fedavg-digits-2" in capsys.readouterr().out
    assert _snapshot(first) == kept
    # --out naming a folder with a run in it: refused, exit 2, nothing touched
    with pytest.raises(SystemExit) as exc:
        fedopt_sim.main(FILES + ["--out", str(first)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "out" in err and "--overwrite" in err, err
    assert _snapshot(first) == kept
    # --overwrite: that run's files are replaced (no stale seed left), other files stay
    (first / "notes.txt").write_text("mine")
    assert fedopt_sim.main(FILES + ["--out", str(first), "--overwrite", "--seeds", "2"]) == 0
    names = set(p.name for p in first.iterdir())
    assert "metrics_seed2.json" in names and "notes.txt" in names and "metrics_seed0.json" not in names
