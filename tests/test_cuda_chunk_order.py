"""The CUDA norm ops sum in one element-to-thread order whatever the tensors' alignment, checked
without a GPU: the kernels' own chunk code (csrc/cuda/norm_chunk.cuh, fednar_op.cuh,
padamfed_op.cuh, sam_ascent_op.cuh) is compiled for the host with the stand-in headers of tests/cuda_host/include
and run thread by thread (tests/cuda_host/chunk_order.cpp). For every thread of a block and both
passes, an unaligned copy of the data (scalar accesses) must give the float64 partial sum and the
written values of the aligned copy (vector accesses), bit for bit, for FedNAR, PAdaMFed (+VR) and
FedSAM's ascent (+ASAM),
float32 and float64, chunk lengths from 1 to a full chunk. The GPU test of the same property runs
the ops themselves: tests/test_native_cuda.py::test_norm_op_on_unaligned_views_is_bitwise_the_aligned_op.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from host_cxx import compiler, generated_include

ROOT = Path(__file__).resolve().parent.parent
HOST = ROOT / "tests" / "cuda_host"


def test_scalar_and_vector_paths_sum_in_one_order(tmp_path):
    exe = tmp_path / "chunk_order"
    generated = generated_include(tmp_path)
    # -ffp-contract=off: no FMA contraction, as the CUDA build's --fmad=false
    build = subprocess.run(
        [
            compiler(),
            "-std=c++17",
            "-O1",
            "-ffp-contract=off",
            "-Wno-unknown-pragmas",
            "-I",
            str(HOST / "include"),
            "-I",
            str(ROOT / "csrc" / "cuda"),
            "-I",
            generated,
            str(HOST / "chunk_order.cpp"),
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("OK"), run.stdout + run.stderr
