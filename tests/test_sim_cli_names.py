"""``fedopt-sim``'s names as a user may write them: ``--algorithm`` in any case (the classes' spelling,
FedNAR, is the README's), ``--validate``'s refusal listing every choice, ``sequential`` included, and
a quiet validation's verdict line, which the main job prints seven of."""

import pytest

from fedopt_kernels.sim.cli import fedopt_sim
from fedopt_kernels.sim.config import VARIANTS


@pytest.mark.parametrize("spelled", ["FedNAR", "SCAFFOLD", "FedNAR-SCAFFOLD", "PAdaMFed-VR", "fedavg"])
def test_an_algorithm_is_taken_in_any_case(spelled):
    args = fedopt_sim.build_parser().parse_args(["--algorithm", spelled])
    assert args.algorithm == spelled.lower() and args.algorithm in VARIANTS
    assert fedopt_sim.config_from_args(args, 0).algorithm == spelled.lower()


def test_an_unknown_algorithm_is_still_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        fedopt_sim.main(["--algorithm", "FedNothing", "--no-files", "--quiet"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--algorithm must be one of" in err and "'fednar'" in err, err


def test_the_validate_refusal_lists_sequential_among_the_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        fedopt_sim.main(["--validate", "bogus", "--rounds", "1", "--no-files", "--quiet"])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "choose 'sequential' (a client-batched run against the sequential one) or one of ('auto'," in err, err


def test_a_quiet_passing_validation_prints_its_verdict_line_alone(capsys):
    argv = ["--algorithm", "FedAvg", "--validate", "reference", "--rounds", "1", "--clients", "6", "--no-files"]
    assert fedopt_sim.main(argv + ["--quiet"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("seed 0: PASS fedavg (reference vs reference, seed 0)"), lines
    assert fedopt_sim.main(argv) == 0
    assert "final accuracy differences" in capsys.readouterr().out  # without --quiet: the tables too
