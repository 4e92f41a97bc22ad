import os

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A fresh random generator per test; the seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("QUANTZOO_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"seed={seed} (replay with QUANTZOO_SEED={seed})")
    return np.random.default_rng(seed)


def pytest_configure(config):
    # Under xdist every worker already owns a core: more torch threads only oversubscribe the
    # 2-core CI machine (tiny-model decode steps ran ~50x slower with 2 threads per worker).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
