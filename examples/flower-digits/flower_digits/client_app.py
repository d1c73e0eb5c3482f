"""ClientApp: local training with fedopt_kernels' optimizers; SuperNode partition-id i is client i."""

from fedopt_kernels.flower.apps import client_app

app = client_app()
