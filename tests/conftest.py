import contextlib
import fcntl
import os
import tempfile

import numpy as np
import pytest


@contextlib.contextmanager
def _flock(config, name, mode):
    """An flock shared by the xdist workers of one test run (a file in the temp directory)."""
    run = getattr(config, "workerinput", {}).get("testrunuid", f"solo-{os.getpid()}")
    with open(os.path.join(tempfile.gettempdir(), f"quantzoo-gpu-{run}.{name}"), "a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _gpu_tier_needs_a_gpu(request):
    """A test marked gpu that runs where there is no GPU fails; it is deselected, never skipped.
    Under xdist the GPU tests share the GPU, except a test marked gpu_alone (its assertions bound
    timings): it waits until no other GPU test function runs and keeps them out while it runs (a
    module-scoped fixture's setup elsewhere is not held back). Readers/writer
    locks: every GPU test holds "lock" shared; gpu_alone takes it exclusively, first taking the
    "gate" so that no new test starts while it waits."""
    if request.node.get_closest_marker("multi_gpu") is not None:
        import torch

        if torch.cuda.device_count() < 2:
            pytest.fail(f"this test needs two GPUs (-m multi_gpu); {torch.cuda.device_count()} visible")
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    import torch

    if not torch.cuda.is_available():
        pytest.fail("this test is in the GPU tier (-m gpu) but no CUDA device is visible")
    from quantzoo.cuda_launch import import_cupy

    import_cupy()  # a CUDA machine without CuPy is an error, not a skip
    with contextlib.ExitStack() as held:
        if request.node.get_closest_marker("gpu_alone") is not None:
            with _flock(request.config, "gate", fcntl.LOCK_EX):
                held.enter_context(_flock(request.config, "lock", fcntl.LOCK_EX))
        else:
            with _flock(request.config, "gate", fcntl.LOCK_SH):
                pass
            held.enter_context(_flock(request.config, "lock", fcntl.LOCK_SH))
        yield


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny-model tests: `pytestmark = pytest.mark.usefixtures("one_torch_thread")`.
    Tiny models run fastest on one thread, also outside xdist (helpers_models.torch_threads)."""
    from helpers_models import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def default_model_file():
    """Path of the default real model, fetched once into the cache; the tests that need it skip
    only when it cannot be downloaded (an offline machine without the cached file)."""
    from quantzoo.model.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        if "could not download" in str(e):
            pytest.skip(f"default model unavailable offline: {e}")
        raise


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
