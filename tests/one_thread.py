"""An autouse fixture for test modules that import it: one torch thread while a test runs (the
Flower simulations start clients in threads of their own; two torch threads each on a 2-core
machine make them several times slower), the caller's setting restored after."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
