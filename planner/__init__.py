"""stratum's planner: from a GGUF header and a hardware profile to a byte-exact, explained VRAM plan.

    from planner import solve, load_plan
    plan = solve(hardware="rtx-5070-ti-16g", model="model.gguf", context=32768, kv="q8_0")
    plan.save("plan.yaml")
"""

__version__ = "0.1.0"

from planner.errors import DoesNotFit, StratumError  # noqa: E402
from planner.plan import Plan, load_plan  # noqa: E402
from planner.solve import solve  # noqa: E402

__all__ = ["solve", "load_plan", "Plan", "StratumError", "DoesNotFit", "__version__"]
