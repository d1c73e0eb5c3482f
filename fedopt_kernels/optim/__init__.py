"""The optimizers, one module each, with their client-batched forms and descriptors.

``fedopt_kernels`` re-exports the public classes (``fedopt_kernels.FedNAR`` …); import them from
there. Importing a module here registers its algorithm (``fedopt_kernels.fl.algorithm``).
"""
