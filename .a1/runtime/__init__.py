"""Executing plans: the engine on top of codegen's kernels (`runtime.engine.Engine`, also `runtime.Engine`), and
the numpy float64 reference (the oracle)."""


def __getattr__(name):
    # imported on first use: `runtime.reference` and `runtime.synthetic` need no numba, the engine does
    if name == "Engine":
        from runtime.engine import Engine
        return Engine
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
