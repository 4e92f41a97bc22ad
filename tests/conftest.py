import os

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A fresh random generator per test; the seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("QUANTZOO_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"seed={seed} (replay with QUANTZOO_SEED={seed})")
    return np.random.default_rng(seed)
