"""Per-GPU configs for every bundled hardware profile x model card: `plans/generated/<profile>/<card>.yaml`.

Pairs that cannot fit are listed with the refusal's words in `plans/generated/README.md`, next to the
predicted speeds of the ones that do, so the folder answers "what runs where, how fast" at a glance.
"""

from pathlib import Path

from planner.errors import DoesNotFit
from planner.model import bundled_cards, load_model
from planner.profile import bundled_profiles, load_profile
from planner.search import solve
from plans import GENERATED_DIR

GENERATED_CONTEXT_TOKENS = 32768
GENERATED_KV = "q8_0"


def generated_files(progress=None) -> dict[str, str]:
    """Relative path -> text of every generated file (plans and the index)."""
    files, rows = {}, []
    models = {card: load_model(card) for card in bundled_cards()}
    for profile_name in bundled_profiles():
        profile = load_profile(profile_name)
        for card, model in models.items():
            if progress:
                progress(f"{profile_name} x {card}")
            context = min(GENERATED_CONTEXT_TOKENS, model.hparams.n_ctx_train)
            try:
                plan = solve(hardware=profile, model=model, context=context, kv=GENERATED_KV)
            except DoesNotFit as refusal:
                rows.append(f"| {profile_name} | {card} | does not fit: {refusal} | | |")
                continue
            files[f"{profile_name}/{card}.yaml"] = plan.to_yaml()
            prefill = max(plan.predictions["prefill"], key=lambda r: r["prompt_tokens"])
            decode = plan.predictions["decode"][0]
            rows.append(f"| {profile_name} | {card} | [plan]({profile_name}/{card}.yaml) | "
                        f"{prefill['tok_s']:g} tok/s at {prefill['prompt_tokens']} | "
                        f"{decode['tok_s']:g} tok/s at depth {decode['depth']} |")
    files["README.md"] = "\n".join([
        "# Generated plans",
        "",
        "Written by `stratum generate` (do not edit by hand): every bundled profile x model card, context "
        f"{GENERATED_CONTEXT_TOKENS} (or the model's, if shorter), K/V {GENERATED_KV}, MTP where the model has a "
        "drafter, the default workload. Speeds are the planner's predictions.",
        "",
        "| profile | model | plan | prefill (longest prompt) | decode |",
        "| --- | --- | --- | ---: | ---: |",
        *rows, ""])
    return files


def generate(out_dir: Path = GENERATED_DIR, progress=None) -> list[Path]:
    """Write every generated file, removing plans for pairs that no longer fit."""
    files = generated_files(progress)
    out_dir = Path(out_dir)
    for stale in out_dir.glob("*/*.yaml"):
        if str(stale.relative_to(out_dir)) not in files:
            stale.unlink()
    written = []
    for relative, text in files.items():
        path = out_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
