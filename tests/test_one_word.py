"""One word for each idea, across code, options, docs and tests.

Each idea had several names, or one name meant several ideas; the words chosen, and the ones retired:

* **client-batched**: all sampled clients of a round trained as one computation (``--client-batched``,
  ``SimConfig.client_batched``, ``sim/batched/``), never "client-parallel" or "lockstep";
* **the layers engine**: the model's own forward code over all clients' samples with client layers
  (``LayersLoss``, ``ClientConv2d``, ``engine="layers"``); "stacked" is the ``[C, *shape]`` layout only;
* **row group**: the parameters sharing one hp row (``row_of``, ``RowGroup``); "batch" is a mini-batch;
* **replay**: a step replayed from a CUDA graph (``--replay``, ``SimConfig.replay``, ``TrainerReplay``);
* a module is named for what it holds (``flower/initial_controls.py``);
* in the kernels and the base optimizer: **factor** is a norm op's per-row-group clip or
  normalisation factor (FedNAR's ``lr * min(1, max_norm / (s + eps))``), never "scale", which is
  GradScaler's (a neuron scale and a client's lr scale say which); **k** is the within-round step
  count, on the device (``FedStepper.k``), on the host until then (``k_host``), and the step calls
  that bound it (``k_bound``); a launch's hp row is its **row**, "group" being a param group (a
  "row group" is the parameters sharing one hp row); the base is ``FedOptimizer``, which owns a
  ``FedStepper`` and its ``Capture``, not a chain of mixins.

A retired word may stay only where it names the deprecated alias that keeps old code working: on a
line that says so ("deprecated", "earlier name"), which exempts the one alias it names, or in
``ALLOWED``, the places that read what was saved under the earlier names. Results in
``bench/results/`` and ``experiments/`` data are records of runs made under the earlier names and
are not read here (their notes are).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

ROOT = Path(__file__).resolve().parents[1]

# retired word -> the pattern that finds it
RETIRED: Dict[str, str] = {
    "client-parallel": r"(?i)client[-_ ]parallel",
    "sim.parallel": r"\bsim[./]parallel\b|\bparallel_round\b|\bcfg\.parallel\b",
    "lockstep": r"(?i)lock-?step",
    "stacked engine": r"(?i)\bstacked (gradient )?engine\b|client-stacked|\bgrad stacked\b",
    "Stacked classes": r"\b(Compiled)?Stacked(Loss|Net|Layer|Conv2d|Linear|LSTM|GroupNorm|LayerNorm|Embedding"
    r"|Sequential)\b",
    "vmap's ClientLoss": r"\bClientLoss\b",
    "stacked modules": r"\bstacked(_types)?\.py\b|\btest_sim_stacked\b|\bNotStackable\b|\bstack_reason\b",
    "engine stacked": r"engine\s*=\s*['\"]stacked['\"]|\"stacked-compiled\"",
    "batch as row group": r"\bint\[\] batch\b|py::arg\(\"batch\"\)|\bplan\.batch\b|\.batches\(\)|\bbatch ind(ex|ices)\b"
    r"|\bper-batch\b|\bclass Batch\b|\bbatch_group\b|\buniform batches\b",
    "cuda-graph": r"--cuda-graph\b|\bcuda_graph\b(?!_)",
    "step graph": r"\bStepGraph\b|\bstep_graph\b|\bgraph_mode\b|\bgraph=\"cuda\"|batched-fused-graph",
    "flower.padamfed": r"\bflower[./]padamfed\b",
    "scale as the clip factor": r"\b_scale_of\b|\bnorm_factor\b|\bscale_all\b|\bex\.scales\b",
    "step count names": r"\b_k_dev\b|\b_k_host\b|\b_host_steps\b|\b_capture_steps\b",
    "a launch's group": r"\blau\.group\b",
    "the base's mixin chain": r"\b(AlgorithmHooks|StepDispatch|PlanGather|CallerGraph|CapturedSteps|RoundAPI"
    r"|ParamChecks|OtherOps|StateFormat)\b|\b(algorithm_hooks|caller_graph|captured_steps|round_api|other_ops)\.py\b"
    r"|\bcore[./](dispatch|gather)\b",
}

# a line naming a deprecated alias says so
MARKER = re.compile(r"(?i)deprecat|earlier name|earlier spelling|before the rename")

# (file, retired word): places that read what was written under the earlier names
ALLOWED: Dict[Tuple[str, str], str] = {
    ("bench/clients_sim.py", "client-parallel"): "results saved before the rename",
    ("bench/clients/results.py", "stacked engine"): "results saved before the rename",
    ("bench/clients/results.py", "step graph"): "results saved before the rename",
    ("fedopt_kernels/sim/resume.py", "client-parallel"): "checkpoints saved before the rename",
    ("fedopt_kernels/sim/resume.py", "cuda-graph"): "checkpoints saved before the rename",
    ("tests/test_sim_resume.py", "client-parallel"): "writes a checkpoint as before the rename",
    ("tests/test_sim_resume.py", "cuda-graph"): "writes a checkpoint as before the rename",
    ("tests/test_sim_cli.py", "client-parallel"): "runs the deprecated options",
    ("tests/test_sim_cli.py", "cuda-graph"): "runs the deprecated options",
    ("tests/test_sim_layers_engine.py", "engine stacked"): "runs the deprecated engine name",
    ("tests/test_warnings.py", "flower.padamfed"): "imports the deprecated module",
    ("tests/test_one_word.py", "*"): "this file names them",
    ("docs/checkpoints.md", "cuda-graph"): "names both earlier names a checkpoint may have been saved under",
}

SKIPPED_DIRS = ("bench/results/", "experiments/protocol/", "experiments/real/", "experiments/paper_scale/")


def sources() -> List[Path]:
    """The files read: the package, the Triton and C++ sources, the benchmark suite, the tests, the docs,
    the README, the examples, the experiments' scripts and notes, CI; bench/results' notes."""
    out: List[Path] = [ROOT / "README.md"]
    for folder in (
        "fedopt_kernels",
        "triton_kernels",
        "csrc",
        "bench",
        "tests",
        "docs",
        "examples",
        "experiments",
        ".ci",
    ):
        for path in sorted((ROOT / folder).rglob("*")):
            rel = path.relative_to(ROOT).as_posix()
            text_file = path.suffix in {".py", ".md", ".sh", ".h", ".cuh", ".cpp", ".cu", ".toml"} or folder == ".ci"
            if path.is_file() and text_file and "__pycache__" not in rel and not rel.startswith(SKIPPED_DIRS):
                out.append(path)
    out += sorted((ROOT / "bench" / "results").glob("notes-*.md"))
    return out


def hits(paths: Iterable[Path], root: Path = ROOT) -> List[Tuple[str, int, str, str]]:
    """``(file, line number, word, line)`` of every retired word, but the deprecated alias a line
    names: on a line that says "deprecated" (or "earlier name"), the retired word it names first."""
    found = []
    patterns = {word: re.compile(p) for word, p in RETIRED.items()}
    for path in paths:
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            words = sorted((m.start(), word) for word, p in patterns.items() for m in [p.search(line)] if m)
            if words and MARKER.search(line):
                words = words[1:]  # the alias the line names as deprecated
            found += [(rel, n, word, line) for _, word in words]
    return found


def retired_words(paths: Iterable[Path], root: Path = ROOT) -> List[str]:
    """``file:line: word: text`` of every retired word outside the deprecated aliases and ``ALLOWED``."""
    return [
        f"{rel}:{n}: {word}: {line.strip()[:120]}"
        for rel, n, word, line in hits(paths, root)
        if (rel, word) not in ALLOWED and (rel, "*") not in ALLOWED
    ]


def test_every_idea_has_one_word():
    found = retired_words(sources())
    why = "retired words (this file's docstring and RETIRED say which, ALLOWED the exceptions):\n"
    assert not found, why + "\n".join(found)


def test_every_allowed_place_still_holds_its_word():
    """An entry of ``ALLOWED`` whose file no longer needs it would let the word back in unseen."""
    used = {(rel, word) for rel, _, word, _ in hits(sources())}
    assert {key for key in ALLOWED if key[1] != "*"} - used == set()


def test_the_check_reads_every_kind_of_file():
    names = {p.relative_to(ROOT).as_posix() for p in sources()}
    assert {
        "README.md",
        "fedopt_kernels/sim/config.py",
        "triton_kernels/launcher.py",
        "csrc/common/binding.h",
        "bench/gpu_check.sh",
        "docs/client_batched.md",
        "experiments/run_protocol.py",
        "bench/results/notes-client-batched.md",
    } <= names
    assert not any(n.startswith(SKIPPED_DIRS) and "/notes-" not in n for n in names)


def test_the_one_word_check_can_fail(tmp_path):
    """A reintroduced word is found, one per idea; the same word on a line naming the deprecated alias is not."""
    samples = [
        "fedopt-sim --client-parallel 10",
        "from fedopt_kernels.sim.parallel.loss import client_loss",
        "the two runs in lockstep",
        "loss = StackedLoss(model)",
        "the stacked engine computes it",
        "plan.batch",
        "cfg.cuda_graph",
        "self.graph_mode = None",
        "from fedopt_kernels.flower.padamfed import InitialControlsStrategy",
        "f = norm_factor(norm, hp, norm_f64)",
        "k = self._k_dev",
        "run(lau.meta, lau.group)",
        "class ParamChecks(CallerGraph):",
    ]
    path = tmp_path / "new.md"
    deprecated = "--client-parallel, the earlier name of --client-batched, is deprecated"
    path.write_text("\n".join(samples + [deprecated, deprecated + ", and runs in lockstep"]))
    found = retired_words([path], root=tmp_path)
    # the alias a deprecation line names is exempt, another retired word on it is not
    want = [str(i) for i in range(1, len(samples) + 1)] + [str(len(samples) + 2)]
    assert [f.split(":")[1] for f in found] == want, found
    assert len({f.split(": ")[1] for f in found[: len(samples)]}) == len(samples)  # each sample is another word
