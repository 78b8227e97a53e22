"""Executing plans: the numpy float64 reference (the oracle) and, on top of codegen's kernels, the engine."""
