"""planner.report: show, svg, explain and diff say what real plans hold, to scale and without losing a byte."""

import dataclasses
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from planner import solve
from planner.report import BAR_WIDTH, SYMBOL, diff, explain, show, svg

SVG_NS = "{http://www.w3.org/2000/svg}"
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
BAR_LINE = re.compile(r"^\s*\|(.*)\|$")


@pytest.fixture(scope="module")
def plans() -> dict:
    """Solved once per module: a small card that binds, a larger one, and a card with VRAM to spare."""
    return {
        "small": solve(hardware="rtx-2060-super-8g", model="glm-4.5-air-q4_k_m", context=32768, kv="q8_0"),
        "large": solve(hardware="rtx-5070-ti-16g", model="glm-4.5-air-q4_k_m", context=32768, kv="q8_0"),
        "roomy": solve(hardware="h200-141g", model="qwen3-30b-a3b-q8_0", context=32768, kv="f16"),
    }


@pytest.fixture(scope="module")
def two_gpu_plan(tmp_path_factory):
    """Two RTX 3090s: a profile made by doubling the bundled one's GPU entry."""
    bundled = Path(__file__).parents[1] / "plans" / "hardware" / "rtx-3090-24g.yaml"
    profile = yaml.safe_load(bundled.read_text())
    profile["name"] = "two-rtx-3090"
    profile["gpus"] = [profile["gpus"][0], dict(profile["gpus"][0])]
    path = tmp_path_factory.mktemp("profiles") / "two-rtx-3090.yaml"
    path.write_text(yaml.safe_dump(profile, sort_keys=False))
    return solve(hardware=str(path), model="glm-4.5-air-q4_k_m")


def all_plans(plans, two_gpu_plan) -> list:
    return list(plans.values()) + [two_gpu_plan]


def bars(text: str) -> list[str]:
    return [m.group(1) for line in text.splitlines() if (m := BAR_LINE.match(line))]


# --- show ------------------------------------------------------------------------------------------

def test_show_names_every_region_with_its_exact_bytes_and_every_knob(plans, two_gpu_plan):
    for plan in all_plans(plans, two_gpu_plan):
        text = show(plan)
        assert plan.model["name"] in text and plan.profile["name"] in text
        assert f"context {plan.settings['context_tokens']}" in text and plan.settings["kv"] in text
        for device in plan.devices:
            for region in device["regions"]:
                assert re.search(rf"^\s*{region['name']}\s.*\b{region['bytes']}\b", text, re.MULTILINE)
            assert str(device["reserved_bytes"]) in text and str(device["free_bytes"]) in text
        for knob in plan.knobs:
            assert re.search(rf"^\s*{knob}\s", text, re.MULTILINE)
        for sentence in plan.binding:
            assert " ".join(sentence.split()) in " ".join(text.split())


def test_show_lists_predictions(plans):
    plan = plans["small"]
    text = show(plan)
    for row in plan.predictions["prefill"]:
        assert re.search(rf"^\s*{row['prompt_tokens']}\s+{row['read_tokens']}\s", text, re.MULTILINE)
    for row in plan.predictions["decode"]:
        assert re.search(rf"^\s*{row['depth']}\s+{row['tok_s']:g}\s", text, re.MULTILINE)
    assert f"{plan.predictions['request_seconds']:g} s" in text


def test_bar_is_fixed_width_and_to_scale(plans, two_gpu_plan):
    for plan in all_plans(plans, two_gpu_plan):
        found = bars(show(plan))
        assert len(found) == len(plan.devices)
        for bar, device in zip(found, plan.devices):
            assert len(bar) == BAR_WIDTH
            segments = [(r["name"], r["bytes"]) for r in device["regions"]]
            segments += [("free", device["free_bytes"]), ("reserved", device["reserved_bytes"])]
            total = sum(size for _, size in segments)
            for name, size in segments:
                exact = size * BAR_WIDTH / total
                assert abs(bar.count(SYMBOL[name]) - exact) < 1, (name, bar)


def test_colored_bar_has_the_same_characters(plans):
    plan = plans["large"]
    colored = show(plan, color=True)
    assert "\x1b[" in colored
    assert bars(ANSI_ESCAPE.sub("", colored)) == bars(show(plan))


# --- svg -------------------------------------------------------------------------------------------

def test_svg_draws_every_region_to_scale(plans, two_gpu_plan):
    for plan in all_plans(plans, two_gpu_plan):
        root = ET.fromstring(svg(plan))
        assert root.tag == f"{SVG_NS}svg"
        rects = root.iter(f"{SVG_NS}rect")
        drawn = [(int(r.get("data-device")), r.get("data-name"), float(r.get("width")))
                 for r in rects if r.get("class") == "region"]
        expected = [(d["index"], r["name"]) for d in plan.devices for r in d["regions"]]
        assert [(device, name) for device, name, _ in drawn] == expected
        sizes = {(d["index"], r["name"]): r["bytes"] for d in plan.devices for r in d["regions"]}
        # One scale for the whole picture: the widest card fills the drawing width.
        scale = drawn[0][2] / sizes[drawn[0][:2]]
        for device, name, width in drawn:
            assert width == pytest.approx(sizes[device, name] * scale, abs=0.01)


def test_svg_shows_free_and_reserved_and_a_legend(plans):
    plan = plans["roomy"]
    text = svg(plan)
    root = ET.fromstring(text)
    classes = [r.get("class") for r in root.iter(f"{SVG_NS}rect")]
    assert classes.count("free") == classes.count("reserved") == len(plan.devices)
    legend = {r.get("data-name") for r in root.iter(f"{SVG_NS}rect") if r.get("class") == "legend"}
    assert legend == {r["name"] for r in plan.devices[0]["regions"]} | {"free", "reserved"}
    texts = " ".join(t.text or "" for t in root.iter(f"{SVG_NS}text"))
    assert plan.model["name"] in texts and plan.profile["name"] in texts
    for region in plan.devices[0]["regions"]:
        assert region["purpose"] in texts


def test_svg_escapes_text(plans):
    plan = plans["small"]
    odd = dataclasses.replace(plan, model={**plan.model, "name": "<a & 'b'>"})
    root = ET.fromstring(svg(odd))
    assert any(t.text == "<a & 'b'> on rtx-2060-super-8g" for t in root.iter(f"{SVG_NS}text"))


# --- explain ---------------------------------------------------------------------------------------

def test_explain_gives_every_knob_its_value_and_reason_and_what_binds(plans, two_gpu_plan):
    for plan in all_plans(plans, two_gpu_plan):
        text = explain(plan)
        assert all(len(line) <= 100 for line in text.splitlines())
        flat = " ".join(text.split())
        for knob, why in plan.explanations.items():
            assert re.search(rf"^{knob} = ", text, re.MULTILINE)
            assert " ".join(why.split()) in flat
        assert "What binds:" in text
        for sentence in plan.binding:
            assert " ".join(sentence.split()) in flat


# --- diff ------------------------------------------------------------------------------------------

def test_diff_of_a_plan_with_itself_is_identical(plans):
    assert diff(plans["small"], plans["small"]).strip() == "the plans are identical"


def test_diff_lists_changed_regions_and_knobs(plans):
    a, b = plans["small"], plans["large"]
    text = diff(a, b)
    assert "rtx-2060-super-8g -> rtx-5070-ti-16g" in text
    regions_a = {r["name"]: r["bytes"] for r in a.devices[0]["regions"]}
    regions_b = {r["name"]: r["bytes"] for r in b.devices[0]["regions"]}
    for name in regions_a.keys() & regions_b.keys():
        line = next((line for line in text.splitlines() if line.strip().startswith(f"{name}:")), None)
        if regions_a[name] == regions_b[name]:
            assert line is None or "same size" in line
        else:
            assert str(regions_a[name]) in line and str(regions_b[name]) in line
            assert f"{regions_b[name] - regions_a[name]:+d} B" in line
    for knob in a.knobs:
        if a.knobs[knob] != b.knobs[knob]:
            assert re.search(rf"^\s*{knob}: .* -> ", text, re.MULTILINE)
        else:
            assert not re.search(rf"^\s*{knob}:", text, re.MULTILINE)
    assert re.search(r"prefill of 4096: .* -> .* tok/s \([+-]\d+\.\d%\)", text)
    assert re.search(r"decode at depth 1024: .* -> .* tok/s \([+-]\d+\.\d%\)", text)


def test_diff_across_models_marks_regions_added_and_removed(plans):
    text = diff(plans["roomy"], plans["small"])
    assert "model: qwen3-30b-a3b-q8_0 -> glm-4.5-air-q4_k_m" in text
    assert "kv: f16 -> q8_0" in text and "mtp: no -> yes" in text
    assert "drafter_experts: added" in text
    assert "drafter_experts: removed" in diff(plans["small"], plans["roomy"])


def test_diff_across_gpu_counts(plans, two_gpu_plan):
    assert len(two_gpu_plan.devices) == 2
    text = diff(plans["small"], two_gpu_plan)
    assert "GPU 1: only in b" in text
    for region in two_gpu_plan.devices[1]["regions"]:
        assert f"{region['name']}: added" in text and str(region["bytes"]) in text
    assert "GPU 1: only in a" in diff(two_gpu_plan, plans["small"])


def test_show_says_which_types_decode_prices_at_q8_0s_rate_when_the_profile_measured_none():
    """A Q4_K_M card on the H200 profile (no decode_weight_rates): the plan lists Q4_K and Q6_K as priced at
    Q8_0's rate, and `show` says so; on the H100 profile, which measured them, and for a Q8_0 card, nothing."""
    unrated = solve(hardware="h200-141g", model="qwen3-30b-a3b-q4_k_m", context=4096)
    assert unrated.predictions["unrated_decode_types"] == ["Q4_K", "Q6_K"]
    flat = " ".join(show(unrated).split())
    assert "Decode reads Q4_K, Q6_K priced at Q8_0's rate: the profile has no decode_weight_rates" in flat
    for hardware, model in (("h100-80g", "qwen3-30b-a3b-q4_k_m"), ("h200-141g", "qwen3-30b-a3b-q8_0")):
        plan = solve(hardware=hardware, model=model, context=4096)
        assert "unrated_decode_types" not in plan.predictions and "priced at Q8_0's rate" not in show(plan)
