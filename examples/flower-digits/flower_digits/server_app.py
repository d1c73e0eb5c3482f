"""ServerApp: the algorithm(s) of the run config, with fedopt_kernels' Flower strategies."""

from fedopt_kernels.flower.apps import server_app

app = server_app()
