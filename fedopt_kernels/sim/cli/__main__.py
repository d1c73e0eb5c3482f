"""``python -m fedopt_kernels.sim.cli``: ``fedopt-sim`` without the console script."""

import sys

from .fedopt_sim import main

sys.exit(main())
