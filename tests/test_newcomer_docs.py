"""The documentation a newcomer reads: it ships with the repository (no links outside it, no private
document names), documents every algorithm with its paper, and the README's two commands are safe
to paste into an interactive shell and are what CI runs."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}


def _user_docs():
    return {"README.md": README, **{f"docs/{k}": v for k, v in DOCS.items()}}


def test_no_reference_to_documents_that_do_not_ship():
    for name, text in _user_docs().items():
        assert "../shared" not in text, name
        assert not re.search(r"\bseeds? 0\d", text, re.I), name
        assert "SPEC.md" not in text, name


def test_docs_exist_and_the_readme_links_them():
    for doc in ("algorithms.md", "backends.md", "benchmarks.md"):
        assert doc in DOCS, doc
        assert f"(docs/{doc}" in README, doc


PAPERS = {
    "FedDecaySGD": "FedDecay: Adapting to Data Heterogeneity in Federated Learning with Gradient Decay",
    "NeuronLRSGD": "FedNLR: Federated Learning with Neuron-wise Learning Rates",
    "FedNAR": "FedNAR: Federated Optimization with Normalized Annealing Regularization",
    "PAdaMFed": "Problem-Parameter-Free Federated Learning",
}


def test_algorithms_doc_has_each_rule_option_and_paper():
    text = DOCS["algorithms.md"]
    for cls, title in PAPERS.items():
        assert f"`{cls}(params" in text, cls  # the signature with its options
        assert title in text, title
    for rule in (
        "lr_k = lr * s(j)",
        "x[m, ...] -= lr * r[m] * buf[m, ...]",
        "coef  = min(1, max_norm / (s + eps))",
        "x   -= eta * v / n",
        "theta' = theta - gamma * mean",
    ):
        assert rule in text, rule
    for api in (
        "start_round(",
        "resolved_backend()",
        "theory_hparams(",
        "local_control()",
        "WithinRoundDecay(",
        "neuron_lr_scales(",
    ):
        assert api in text, api
    assert "server step size" in text and "float64" in text
    assert re.search(r"\(https://doi\.org/10\.1145/3637528\.3672042\)", text)


def test_readme_explains_gamma_and_resolved_backend():
    assert re.search(r"`gamma` (is )?the server step size", README)
    assert "resolved_backend()" in README
    for extra in ("[sim]", "[bench]", "[triton]", "[test]"):
        assert f"`{extra}`" in README, extra


def _command(title: str) -> str:
    m = re.search(rf"^{title}.*?\n```bash\n(.+?)\n```", README, re.S | re.M)
    assert m, title
    return m.group(1).strip()


def test_ci_runs_the_readme_test_command_verbatim():
    assert _command("Tests") in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_main_job_failure_does_not_close_the_shell():
    cmd = _command("Main job")
    assert "setuptools>=77" in cmd and "--quiet" in cmd
    loop = cmd[cmd.index("python -m bench --quick") :]
    # the same command with every step but one FL run replaced: that run fails
    loop = loop.replace("python -m bench --quick", "true")
    loop = re.sub(r"fedopt-sim [^|;)]*", 'test "$a" != fednar-scaffold ', loop)
    proc = subprocess.run(
        ["bash", "-c", f"{loop}; echo STILL-HERE status=$?"], capture_output=True, text=True, timeout=60
    )
    assert "STILL-HERE status=1" in proc.stdout, (loop, proc.stdout, proc.stderr)


def test_readme_states_how_long_the_commands_take():
    assert re.search(r"main job took\s+\d+(\.\d+)?\s(s|min)", README), "measured main-job time"
    assert re.search(r"tests\s+command\s+took\s+\d+(\.\d+)?\s(s|min)", README), "measured test time"


def _headings(text: str) -> list:
    """The markdown lines that start with '#', code blocks left out."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return [ln for ln in prose.splitlines() if ln.startswith("#")]


def _diary(text: str) -> list:
    """What marks a measurement diary: a commit hash in backticks, a load average."""
    return re.findall(r"`[0-9a-f]{7,40}`|load average", text)


def test_each_document_has_one_title_and_no_diary():
    """docs/ is reference: one H1 each, and measurements (with their commits and the machine's load)
    live in bench/results/, which the docs link."""
    for name, text in _user_docs().items():
        heads = _headings(text)
        titles = [h for h in heads if h.startswith("# ")]
        assert len(titles) == 1 and heads[0] == titles[0], (name, titles)
        assert not _diary(text), (name, _diary(text))


def test_the_document_checks_can_fail():
    assert len([h for h in _headings("# A\n\n```bash\n# a comment\n```\n\n# B\n") if h.startswith("# ")]) == 2
    assert _diary("measured at commit `b018500` (load average 6.5)") == ["`b018500`", "load average"]


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    return README[start : README.index("\n## ", start + 1)]


CPU_WHEEL = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def test_a_cpu_only_user_reads_how_to_keep_cuda_off_at_the_commands():
    """The CPU wheel's command stands in "The two commands", before the first of them, and each
    command's install asks for torch without a version, so that it keeps the torch it finds."""
    section = _section("The two commands")
    assert CPU_WHEEL in section and section.index(CPU_WHEEL) < section.index("```bash"), section[:600]
    for title in ("Main job", "Tests"):
        first = shlex.split(_command(title).split("&&")[0])
        assert first[:3] == ["pip", "install", "torch"], first  # "torch" alone: no pin that replaces a CPU wheel


def test_the_install_keeps_the_installed_torch_and_adds_no_cuda_libraries(tmp_path):
    """What the words promise, without a download: pip, asked (offline, as a dry run) for the README's
    editable install with the test extra in this environment, would install the package alone - no
    other torch, no nvidia-* or CUDA package."""
    install = shlex.split(_command("Tests").split("&&")[1])
    assert install[:3] == ["pip", "install", "-e"], install
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *install[1:], "--dry-run", "--no-index", "--report", str(report), "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = [item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]]
    assert names == ["fedopt_kernels"] or names == ["fedopt-kernels"], names
