"""Kernels run in numba's CUDA simulator unless the environment says otherwise: CI has no GPU. On the H200,
`NUMBA_ENABLE_CUDASIM=0 python3 -m pytest -m gpu` runs the real-GPU tests. This must happen before numba
is first imported, which is why it lives here."""

import os
import warnings

import numpy as np
import pytest

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
warnings.filterwarnings("ignore", message=".*(under-utilization|copy overhead).*")   # tiny simulated launches

from codegen.lower.cuda import SIMULATOR  # noqa: E402 (numba reads NUMBA_ENABLE_CUDASIM when first imported)

if SIMULATOR:
    from tests.simulator import install
    install()


@pytest.fixture
def rng(request):
    """A fresh generator per test, printed (pytest shows it on failure), so inputs are
    random but a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def pytest_collection_modifyitems(config, items):
    if not SIMULATOR:
        return
    skip = pytest.mark.skip(reason="needs a real GPU (NUMBA_ENABLE_CUDASIM=0 pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
