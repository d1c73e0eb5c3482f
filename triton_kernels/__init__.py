"""Triton kernels of fedopt_kernels (installed as ``fedopt_kernels.triton_kernels``)."""
