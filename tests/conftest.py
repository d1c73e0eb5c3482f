"""Test-wide setup.

Without a GPU, Triton kernels run on CPU tensors under the Triton interpreter. The variable is read
when a kernel is decorated, so it must be set before ``fedopt_kernels.triton_kernels`` is imported:
this file runs before any test module.
"""

import os
import shutil
import tempfile

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Ray (Flower's simulation engine) warns that it will stop overriding CUDA_VISIBLE_DEVICES for
# actors that ask for no GPU; the tests opt into that behaviour now rather than hear the warning
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

# Every temporary file of a run - the tests' tmp_path folders, the files the processes they start
# make with tempfile, Ray's session folders (which Ray keeps after it stops), Flower's home (~/.flwr
# otherwise) - goes into one folder, which the first pytest process makes and removes at the end of
# a run that passed; a run that did not pass keeps it to look at and says where. xdist's workers and
# every process a test starts inherit TMPDIR and use the same folder.
SCRATCH_VAR = "FEDOPT_TESTS_SCRATCH"
_OWNER = SCRATCH_VAR not in os.environ
if _OWNER:
    os.environ[SCRATCH_VAR] = tempfile.mkdtemp(prefix="fedopt-tests-")
SCRATCH = os.environ[SCRATCH_VAR]
os.environ["TMPDIR"] = SCRATCH
tempfile.tempdir = SCRATCH  # this process's tempfile has already read TMPDIR (pytest's capture asked it)
os.environ.setdefault("FLWR_HOME", os.path.join(SCRATCH, "flwr-home"))
_EXIT = {"status": None}


# Caches worth keeping between runs (torch.compile's and Triton's compiled kernels, matplotlib's font
# list) go to pytest's cache folder inside the clone (.pytest_cache, git-ignored; --cache-clear
# empties it) rather than /tmp or the home folder; to the run's folder where pytest has no cache.
CACHES = {"TORCHINDUCTOR_CACHE_DIR": "torchinductor", "TRITON_CACHE_DIR": "triton", "MPLCONFIGDIR": "matplotlib"}


def pytest_configure(config):
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    for var, name in CACHES.items():
        if var not in os.environ:  # the user's, or set by the process that started this one
            folder = cache.mkdir(f"fedopt-{name}") if cache is not None else os.path.join(SCRATCH, name)
            os.environ[var] = str(folder)


def pytest_sessionfinish(session, exitstatus):
    _EXIT["status"] = int(exitstatus)


def pytest_terminal_summary(terminalreporter, exitstatus):
    if _OWNER and int(exitstatus) != 0:
        terminalreporter.write_line(f"temporary files of this run kept in {SCRATCH}")


def pytest_unconfigure(config):
    if _OWNER and _EXIT["status"] == 0:
        shutil.rmtree(SCRATCH, ignore_errors=True)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# Under pytest-xdist (the README's test command) each worker is a process of its own; torch's default
# of one thread per core in each of them would put several threads on every core, and threads that
# spin waiting for each other slow everything down. The cores are shared out instead; tests that
# are about thread counts set their own.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, _cores() // _WORKERS))


# The fast tier (`pytest -m "not slow"`, docs/testing.md) leaves out, besides tests marked slow in
# their file: whole files that build, install, start processes or train end to end, and every case
# run through the Triton interpreter. The full suite (CI) runs everything.
SLOW_FILES = frozenset(
    {
        "test_amp.py",
        "test_bench_clients.py",
        "test_bench_junit.py",
        "test_bench_loop.py",
        "test_bench_smoke.py",
        "test_compile.py",
        "test_cuda_build.py",
        "test_cuda_chunk_order.py",
        "test_dtensor.py",
        "test_experiments_protocol.py",
        "test_flower_engine.py",
        "test_flower_privacy.py",
        "test_flower_resume.py",
        "test_flower_strategies.py",
        "test_hardening.py",
        "test_leaves_nothing.py",
        "test_native_build_rules.py",
        "test_newcomer_bench.py",
        "test_newcomer_docs.py",
        "test_newcomer_extras.py",
        "test_newcomer_jit.py",
        "test_newcomer_packaging.py",
        "test_paper_commands.py",
        "test_privacy_runs.py",
        "test_ops.py",
        "test_properties.py",
        "test_replay.py",
        "test_server_optimizers_all.py",
        "test_sim_batched.py",
        "test_sim_cli.py",
        "test_sim_data_cifar.py",
        "test_sim_data_femnist.py",
        "test_sim_data_idx.py",
        "test_sim_data_shakespeare.py",
        "test_sim_dropouts.py",
        "test_sim_evaluate.py",
        "test_sim_rank_agreement.py",
        "test_sim_ranks.py",
        "test_sim_resume.py",
        "test_sim_resume_kill.py",
        "test_torch_conventions.py",
        "test_triton_aot.py",
        "test_triton_launcher.py",
    }
)


def pytest_ignore_collect(collection_path, config):
    # the fast tier does not even import the files it leaves out (Flower's, for one, take seconds)
    if config.getoption("markexpr", "").split() == ["not", "slow"] and collection_path.name in SLOW_FILES:
        return True
    return None


def _slow(item) -> bool:
    if item.path.name in SLOW_FILES:
        return True
    params = getattr(item, "callspec", None)
    return params is not None and "triton" in params.id.split("-")


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        if _slow(item):
            item.add_marker(slow)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (the simulator's models are tiny: threads only add overhead)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
