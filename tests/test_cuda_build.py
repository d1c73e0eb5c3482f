"""The built CUDA extension, inspected without a GPU (tools: the ``cuobjdump`` in the triton wheel, nvcc):

* it holds SASS for sm_86 and sm_90 (and PTX for forward compatibility);
* the float32 hot loops use 128-bit global loads and stores (LDG.E.128 / STG.E.128);
* no kernel spills: ``ptxas -v`` reports 0 spill bytes when the .cu files are compiled with the
  build's flags, and the resource usage of the built kernels shows no stack / local memory;
* every kernel's arguments (the __grid_constant__ tensor tables) fit the portable 4 KiB;
* the client-batched ops (``<op>_batched``) are bound and run these same kernels: their tables hold
  one row per stacked tensor and the client count, so the checks above cover them too, and no
  separate batched kernel exists.

Skipped (with the reason) when the extension was deliberately not built (no nvcc, CPU-only torch,
FEDOPT_BUILD_CUDA=0); a *failed* build with nvcc present is a test failure.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict

import pytest
from host_cxx import generated_include

ROOT = Path(__file__).resolve().parent.parent
CUDA_DIR = ROOT / "csrc" / "cuda"
KERNEL_FILES = sorted(p.name for p in CUDA_DIR.glob("*.cu"))  # every .cu is built (csrc/build.py)
ARCHS = ("86", "90")


def _built_library() -> Path:
    spec = importlib.util.find_spec("fedopt_kernels._C_cuda")
    if spec is not None and spec.origin:
        return Path(spec.origin)
    import fedopt_kernels

    status = Path(fedopt_kernels.__file__).parent / "_C_cuda.build-status.txt"
    reason = status.read_text().strip() if status.is_file() else "no build status recorded"
    if reason.startswith("build failed") or (not status.is_file() and shutil.which("nvcc")):
        pytest.fail(f"nvcc is present but fedopt_kernels._C_cuda was not built: {reason}")
    pytest.skip(f"fedopt_kernels._C_cuda was not built: {reason}")


def _cuobjdump() -> str:
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.origin:
        pytest.skip("triton is not installed (its wheel ships cuobjdump)")
    tool = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        pytest.skip(f"no cuobjdump in the triton wheel at {tool}")
    return str(tool)


def _run(cmd) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{res.stdout}\n{res.stderr}"
    return res.stdout + res.stderr


@pytest.fixture(scope="module")
def lib() -> Path:
    return _built_library()


def test_holds_sm86_and_sm90_code(lib):
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        pytest.skip("TORCH_CUDA_ARCH_LIST is set: the build targets those architectures instead")
    elf = _run([_cuobjdump(), "--list-elf", str(lib)])
    for arch in ARCHS:
        for f in KERNEL_FILES:
            stem = f[:-3]
            assert re.search(rf"\b{stem}\.sm_{arch}\.cubin", elf), f"no sm_{arch} code for {f} in {lib.name}:\n{elf}"
    ptx = _run([_cuobjdump(), "--list-ptx", str(lib)])
    assert "sm_90.ptx" in ptx, "no PTX for GPUs newer than sm_90"


def _sass_by_function(sass: str):
    """{mangled kernel name: its SASS text} (one cubin's worth of each name is enough)."""
    out: Dict[str, str] = {}
    for block in re.split(r"\n\s*Function : ", sass)[1:]:
        name, _, body = block.partition("\n")
        out.setdefault(name.strip(), body)
    return out


def _built_archs(lib: Path) -> set:
    """The sm_XY architectures the library holds SASS for (TORCH_CUDA_ARCH_LIST may narrow the build)."""
    return set(re.findall(r"\.sm_(\d+)\.cubin", _run([_cuobjdump(), "--list-elf", str(lib)])))


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_hot_loops_use_128bit_accesses(lib, arch):
    built = _built_archs(lib)
    if arch not in built:
        pytest.skip(
            f"the extension holds no sm_{arch} code (built for sm_{', sm_'.join(sorted(built))}; "
            f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '')!r})"
        )
    sass = _run([_cuobjdump(), "-sass", "-arch", f"sm_{arch}", str(lib)])
    funcs = _sass_by_function(sass)
    # float32 instantiations: sgd_kernel<float>, two_pass_kernel<NarOp|PadOp, float, pass>
    wanted = {n: b for n, b in funcs.items() if re.search(r"sgd_kernelIf|two_pass_kernel.*(NarOp|PadOp)Ef", n)}
    assert len(wanted) == 5, f"expected 5 float32 streaming kernels, found {sorted(wanted)}"
    for name, body in wanted.items():
        assert "LDG.E.128" in body, f"{name} has no 128-bit global load"
        writes = "NarOpEfLb0" not in name  # FedNAR's norm pass only reads
        if writes:
            assert "STG.E.128" in body, f"{name} has no 128-bit global store"


def test_kernel_arguments_fit_the_portable_4kib(lib):
    """The tables are sized to the 4 KiB every supported CUDA version accepts (static_asserts in
    csrc/cuda); this reads what the compiler laid out: end of the last parameter of each kernel."""
    elf = _run([_cuobjdump(), "-elf", str(lib)])
    ends = {}
    for section in re.split(r"\n(?=\.nv\.info\.)", elf)[1:]:
        name = section.split("\n", 1)[0][len(".nv.info.") :].strip()
        for off, size in re.findall(r"Offset\s*:\s*0x([0-9a-f]+)\s+Size\s*:\s*0x([0-9a-f]+)", section):
            ends[name] = max(ends.get(name, 0), int(off, 16) + int(size, 16))
    streaming = {n: e for n, e in ends.items() if re.search(r"sgd_kernel|two_pass_kernel", n)}
    assert len(streaming) >= 20, f"expected the 20 streaming kernels' parameter info, found {sorted(ends)}"
    for name, end in ends.items():
        assert end <= 4096, f"{name} takes {end} bytes of kernel arguments (> 4 KiB)"
    # the tables use most of the room: a table that shrank by accident (fewer tensors per launch) shows
    assert min(streaming.values()) > 3000, streaming


def test_batched_ops_are_bound_with_the_per_client_roles(lib):
    import fedopt_kernels._C_cuda as ext

    for base in ("sgd", "fednar", "padamfed"):
        assert hasattr(ext, f"{base}_batched"), f"_C_cuda has no {base}_batched"
        assert ext.op_signature(f"{base}_batched") == ext.op_signature(base)


def test_both_extensions_load_in_one_process(lib):
    """_C_cpu and _C_cuda bind the same C++ class (the step plan's gradient watch); both must import
    into one process in either order, each handing out its own watch."""
    code = (
        "import sys, torch\n"
        "order = sys.argv[1:]\n"
        "mods = [__import__('fedopt_kernels.' + n, fromlist=['x']) for n in order]\n"
        "ps = [torch.zeros(3, requires_grad=True)]\n"
        "for m in mods:\n"
        "    w = m.GradWatch(ps, [0])\n"
        "    assert isinstance(w.accept(), int)\n"
        "print('OK', len(mods))\n"
    )
    for order in (["_C_cpu", "_C_cuda"], ["_C_cuda", "_C_cpu"]):
        if importlib.util.find_spec("fedopt_kernels._C_cpu") is None:
            pytest.skip("no built _C_cpu")
        proc = subprocess.run(
            [sys.executable, "-c", code, *order], capture_output=True, text=True, cwd=ROOT, timeout=300
        )
        assert proc.returncode == 0 and "OK 2" in proc.stdout, (order, proc.stderr[-2000:])


def test_built_kernels_use_no_local_memory(lib):
    usage = _run([_cuobjdump(), "-res-usage", str(lib)])
    rows = re.findall(r"Function (\S+):\s*\n\s*(REG:.*)", usage)
    assert rows, f"no resource usage found:\n{usage[:2000]}"
    for name, row in rows:
        stack = int(re.search(r"STACK:(\d+)", row).group(1))
        local = int(re.search(r"LOCAL:(\d+)", row).group(1))
        assert stack == 0 and local == 0, f"{name} uses stack/local memory (spills?): {row}"


def _nvcc() -> str:
    try:
        import torch.utils.cpp_extension  # noqa: F401

        spec = importlib.util.spec_from_file_location("fedopt_build", ROOT / "csrc" / "build.py")
        assert spec is not None and spec.loader is not None
        build = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(build)
        home = build.find_cuda_home()
    except Exception:
        home = None
    if home is None:
        pytest.skip("nvcc not found")
    return os.path.join(home, "bin", "nvcc")


def test_ptxas_reports_no_spills(lib, tmp_path):
    nvcc = _nvcc()
    generated = generated_include(tmp_path)

    def compile_one(job):
        src, arch = job
        # the build's device flags (csrc/build.py); -cubin skips host compilation
        return (
            src,
            arch,
            _run(
                [
                    nvcc,
                    "-cubin",
                    "-O3",
                    "--fmad=false",
                    "-std=c++17",
                    f"-arch=sm_{arch}",
                    "-Xptxas",
                    "-v",
                    "-I",
                    generated,
                    "-o",
                    str(tmp_path / f"{src}.{arch}.cubin"),
                    str(CUDA_DIR / src),
                ]
            ),
        )

    jobs = [(f, a) for f in KERNEL_FILES for a in ARCHS]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = list(pool.map(compile_one, jobs))
    for src, arch, log in results:
        entries = re.findall(r"Compiling entry function '(\S+)' for 'sm_\d+'", log)
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        if src != "launch_common.cu" or entries:
            assert entries and len(spills) >= len(entries), f"unexpected ptxas output for {src}:\n{log}"
        for st, ld in spills:
            assert st == "0" and ld == "0", f"{src} sm_{arch}: ptxas reports spills:\n{log}"
