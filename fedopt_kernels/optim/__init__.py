"""The optimizers: ``torch.optim`` classes, one module each, with their client-batched forms.

``fedopt_kernels`` re-exports the public classes (``fedopt_kernels.FedNAR`` …); import them from
there. Nothing here knows FL rounds' servers or variants: each algorithm's FL descriptor is
``fedopt_kernels/fl/algorithms/<name>.py``.
"""
