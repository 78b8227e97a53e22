"""Bundled data: hardware profiles, model cards and the generated per-GPU plans."""

from pathlib import Path

PLANS_DIR = Path(__file__).resolve().parent
HARDWARE_DIR = PLANS_DIR / "hardware"
MODELS_DIR = PLANS_DIR / "models"
GENERATED_DIR = PLANS_DIR / "generated"
