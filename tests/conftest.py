"""Kernels run in numba's CUDA simulator unless the environment says otherwise: CI has no GPU. On the H200,
`NUMBA_ENABLE_CUDASIM=0 python3 -m pytest -m gpu` runs the real-GPU tests. This must happen before numba
is first imported, which is why it lives here."""

import os
import sys
import warnings

import numpy as np
import pytest

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
# The simulator runs each CUDA thread as a Python thread that waits at every syncthreads; a short switch
# interval hands the GIL on at once instead of after 5 ms, which makes simulated kernels about 5x faster.
sys.setswitchinterval(1e-5)
warnings.filterwarnings("ignore", message=".*(under-utilization|copy overhead).*")   # tiny simulated launches


@pytest.fixture
def rng(request):
    """A fresh generator per test, printed (pytest shows it on failure), so inputs are
    random but a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def pytest_collection_modifyitems(config, items):
    from codegen.lower.cuda import SIMULATOR
    if not SIMULATOR:
        return
    skip = pytest.mark.skip(reason="needs a real GPU (NUMBA_ENABLE_CUDASIM=0 pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
