"""fedopt_kernels' algorithms on Flower, on the simulator's digits users."""
