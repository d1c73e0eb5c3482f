"""Fused backends. Importing ``fedopt_kernels.core.backends.<name>`` registers that backend's ops with
``fedopt_kernels.core.registry`` (and its device check); an import error means "not available here",
and its message is what ``available_backends()`` reports."""
