"""stratum's planner: from a GGUF header and a hardware profile to a byte-exact, explained VRAM plan.

    from planner import solve, load_plan
    plan = solve(hardware="rtx-5070-ti-16g", model="model.gguf", context=32768, kv="q8_0")
    plan.save("plan.yaml")
"""

__version__ = "0.1.0"
__all__ = ["solve", "load_plan", "Plan", "StratumError", "DoesNotFit", "__version__"]

_EXPORTS = {"solve": "planner.search", "load_plan": "planner.plan", "Plan": "planner.plan",
            "StratumError": "planner.errors", "DoesNotFit": "planner.errors"}


def __getattr__(name):
    # resolved on first use: codegen imports planner's submodules, and the planner imports codegen
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
