"""Pass graphs, their static memory and cost, and (later) their lowering to numba.cuda kernels.

Importing `codegen` imports no numba: the planner uses `graph`, `memory` and `cost` alone.
"""
