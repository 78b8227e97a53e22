"""Hardware profiles: the bundled ones load, bad files are refused with a message naming file and field."""

import copy

import pytest
import yaml

from planner.errors import StratumError
from planner.profile import KernelFit, bundled_profiles, load_profile

BUNDLED = [
    "h100-80g",
    "h200-141g",
    "rtx-2060-super-8g",
    "rtx-3090-24g",
    "rtx-4090-24g",
    "rtx-5070-ti-16g",
    "rtx-5090-32g",
    "rx-7900-xtx-24g",
]

GPU = {
    "name": "Test GPU",
    "vram": "8 GiB",
    "sms": 36,
    "reserved": "512 MiB",
    "memory_bandwidth": "403 GB/s",
    "fp32": "7.18 TFLOPS",
    "fp16": "28.7 TFLOPS",
    "host_to_device": "6.5 GB/s",
    "device_to_host": "6.5 GB/s",
    "zero_copy_read": "6 GB/s",
    "copy_latency": "10 us",
    "graph_node_overhead": "1 us",
}
DOC = {"name": "test", "description": "a test profile", "gpus": [GPU], "host": {"ram": "64 GiB", "pinned_budget": "48 GiB"}}


def write(tmp_path, doc, name="profile.yaml"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False))
    return path


def variant(**gpu_changes):
    """DOC with gpus[0] changed; a value of None drops the field."""
    doc = copy.deepcopy(DOC)
    for field, value in gpu_changes.items():
        if value is None:
            del doc["gpus"][0][field]
        else:
            doc["gpus"][0][field] = value
    return doc


def refused(path) -> str:
    with pytest.raises(StratumError) as info:
        load_profile(path)
    return str(info.value)


# --- bundled profiles -------------------------------------------------------------------------------------------

def test_bundled_profiles_lists_all_eight():
    assert set(BUNDLED) <= set(bundled_profiles())


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_profile_loads(name):
    profile = load_profile(name)
    assert profile.name == name
    assert profile.description
    assert len(profile.gpus) == 1
    gpu = profile.gpus[0]
    assert gpu.usable_bytes > 0
    for rate in (gpu.memory_bandwidth_bytes_per_s, gpu.host_to_device_bytes_per_s, gpu.device_to_host_bytes_per_s,
                 gpu.zero_copy_read_bytes_per_s, gpu.fp32_flops, gpu.fp16_flops):
        assert rate > 0
    assert gpu.memory_bandwidth_bytes_per_s > gpu.host_to_device_bytes_per_s
    assert gpu.zero_copy_read_bytes_per_s <= gpu.host_to_device_bytes_per_s
    assert 0 < gpu.copy_latency_s < 1e-3 and 0 < gpu.graph_node_overhead_s < 1e-4
    assert 0 < profile.host.pinned_budget_bytes <= profile.host.ram_bytes


def test_h200_leaves_139_gib_usable():
    gpu = load_profile("h200-141g").gpus[0]
    assert gpu.vram_bytes == 143771 * 2**20
    assert gpu.usable_bytes == 139 * 2**30


def test_good_file_parses_with_units(tmp_path):
    profile = load_profile(write(tmp_path, DOC))
    gpu = profile.gpus[0]
    assert gpu.vram_bytes == 8 * 2**30 and gpu.usable_bytes == 8 * 2**30 - 512 * 2**20
    assert gpu.memory_bandwidth_bytes_per_s == 403e9
    assert gpu.copy_latency_s == pytest.approx(10e-6)


def test_defaults(tmp_path):
    profile = load_profile(write(tmp_path, variant(zero_copy_read=None, copy_latency=None, graph_node_overhead=None)))
    gpu = profile.gpus[0]
    assert gpu.zero_copy_read_bytes_per_s == gpu.host_to_device_bytes_per_s
    assert gpu.copy_latency_s == pytest.approx(10e-6)
    assert gpu.graph_node_overhead_s == pytest.approx(1e-6)
    assert gpu.kernel_launch_s == pytest.approx(25e-6)


def test_the_ring_calls_default_to_kernel_launch_and_read_back(tmp_path):
    """A profile without `copy_call` and `event_call` prices them as kernel launches (the cost model before
    detect measured them); given, each reads back as written."""
    gpu = load_profile(write(tmp_path, variant(kernel_launch="17 us"))).gpus[0]
    assert gpu.copy_call_s == gpu.event_call_s == pytest.approx(17e-6)
    gpu = load_profile(write(tmp_path, variant(copy_call="6.5 us", event_call="2.25 us"))).gpus[0]
    assert (gpu.copy_call_s, gpu.event_call_s) == (pytest.approx(6.5e-6), pytest.approx(2.25e-6))
    assert "copy_call" in refused(write(tmp_path, variant(copy_call="fast")))


def test_the_host_page_tables_default_to_the_h200s_and_read_back(tmp_path):
    assert load_profile(write(tmp_path, variant())).gpus[0].host_page_table_entry_bytes == 8
    assert load_profile(write(tmp_path, variant(host_page_table_entry="16 B"))).gpus[0].host_page_table_entry_bytes == 16
    assert "host_page_table_entry" in refused(write(tmp_path, variant(host_page_table_entry="many")))


def test_multi_gpu_profile(tmp_path):
    doc = copy.deepcopy(DOC)
    second = dict(GPU, name="Second GPU", vram="24 GiB", reserved="700 MiB")
    doc["gpus"].append(second)
    profile = load_profile(write(tmp_path, doc))
    assert [g.name for g in profile.gpus] == ["Test GPU", "Second GPU"]
    assert profile.gpus[1].usable_bytes == 24 * 2**30 - 700 * 2**20


def test_multi_gpu_error_names_the_device(tmp_path):
    doc = copy.deepcopy(DOC)
    doc["gpus"].append({k: v for k, v in GPU.items() if k != "fp32"})
    message = refused(write(tmp_path, doc))
    assert "gpus[1].fp32" in message and "missing" in message


# --- refusals ---------------------------------------------------------------------------------------------------

def test_missing_field(tmp_path):
    path = write(tmp_path, variant(memory_bandwidth=None))
    message = refused(path)
    assert str(path) in message and "gpus[0].memory_bandwidth" in message and "missing" in message


@pytest.mark.parametrize("value", [0, 13.5, "132 SMs", True])
def test_sms_is_a_whole_positive_count(tmp_path, value):
    message = refused(write(tmp_path, variant(sms=value)))
    assert "gpus[0].sms" in message and "whole positive number" in message


def test_tiled_kernel_fit_reads_back(tmp_path):
    """The tiled families' extra terms (codegen.cost.tiled_s) read back; left out, a weight element is free and
    a further tile costs a first one."""
    path = write(tmp_path, variant(kernels={"prefill_matmul": {"efficiency": 0.9, "latency": "6 us",
                                                               "weight_element": "0.328 ns", "further_tile": 0.8},
                                            "prefill_experts": {"efficiency": 0.7}}))
    kernels = load_profile(path).gpus[0].kernels
    assert kernels.prefill_matmul.weight_element_s == pytest.approx(0.328e-9)
    assert kernels.prefill_matmul.further_tile == 0.8
    assert (kernels.prefill_experts.weight_element_s, kernels.prefill_experts.further_tile) == (0.0, 1.0)


def test_negative_field(tmp_path):
    path = write(tmp_path, variant(vram="-8 GiB"))
    message = refused(path)
    assert str(path) in message and "gpus[0].vram" in message and "negative" in message


def test_zero_bandwidth(tmp_path):
    path = write(tmp_path, variant(host_to_device="0 GB/s"))
    message = refused(path)
    assert str(path) in message and "gpus[0].host_to_device" in message and "positive" in message


@pytest.mark.parametrize("value", [8, 8.0, "8"])
def test_unitless_field(tmp_path, value):
    path = write(tmp_path, variant(vram=value))
    message = refused(path)
    assert str(path) in message and "gpus[0].vram" in message and "no unit" in message


def test_unknown_unit(tmp_path):
    path = write(tmp_path, variant(vram="8 gigs"))
    message = refused(path)
    assert str(path) in message and "gpus[0].vram" in message and "unknown unit" in message and "gigs" in message


def test_wrong_kind_of_unit(tmp_path):
    path = write(tmp_path, variant(memory_bandwidth="403 GB"))      # a size where a bandwidth is expected
    message = refused(path)
    assert str(path) in message and "gpus[0].memory_bandwidth" in message and "unknown unit" in message


def test_unknown_field(tmp_path):
    doc = variant(memory_bandwidth=None)
    doc["gpus"][0]["memory_bandwith"] = "403 GB/s"
    path = write(tmp_path, doc)
    message = refused(path)
    assert str(path) in message and "gpus[0].memory_bandwith" in message and "unknown field" in message


def test_unknown_top_level_field(tmp_path):
    doc = copy.deepcopy(DOC)
    doc["gpu"] = doc.pop("gpus")
    message = refused(write(tmp_path, doc))
    assert "gpu" in message and "unknown field" in message


@pytest.mark.parametrize("reserved", ["8 GiB", "9 GiB"])
def test_reserved_not_below_vram(tmp_path, reserved):
    path = write(tmp_path, variant(reserved=reserved))
    message = refused(path)
    assert str(path) in message and "gpus[0].reserved" in message and "vram" in message


def test_not_yaml(tmp_path):
    path = write(tmp_path, "gpus: [ {vram: 8 GiB\nhost: {ram: 64 GiB")
    message = refused(path)
    assert str(path) in message and "not valid YAML" in message


def test_not_a_mapping(tmp_path):
    path = write(tmp_path, "- just\n- a list\n")
    assert str(path) in refused(path)


def test_unknown_profile_name():
    message = refused("rtx-9090-48g")
    assert "rtx-9090-48g" in message
    for name in BUNDLED:
        assert name in message


def test_pinned_budget_above_ram(tmp_path):
    doc = copy.deepcopy(DOC)
    doc["host"]["pinned_budget"] = "65 GiB"
    path = write(tmp_path, doc)
    message = refused(path)
    assert str(path) in message and "host.pinned_budget" in message and "host.ram" in message


def test_missing_host_field(tmp_path):
    doc = copy.deepcopy(DOC)
    del doc["host"]["ram"]
    message = refused(write(tmp_path, doc))
    assert "host.ram" in message and "missing" in message


# --- fingerprint ------------------------------------------------------------------------------------------------

REFORMATTED = """\
# the same figures as DOC, written differently
name: another name
description: reformatted
host: {pinned_budget: 49152MiB, ram: 65536 MiB}
gpus:
- graph_node_overhead: 1us
  copy_latency: "10  us"
  zero_copy_read: 6000 MB/s
  device_to_host: 6500 MB/s
  host_to_device: 6.5GB/s
  fp16: 28700 GFLOPS
  fp32: 7180 GFLOPS
  memory_bandwidth: 403000 MB/s
  reserved: 0.5 GiB
  vram: 8192 MiB
  sms: 36
  name: Test GPU
"""


def test_fingerprint_ignores_formatting(tmp_path):
    original = load_profile(write(tmp_path, DOC, "a.yaml"))
    reformatted = load_profile(write(tmp_path, REFORMATTED, "b.yaml"))
    assert reformatted.fingerprint == original.fingerprint


@pytest.mark.parametrize("change", [{"vram": "8 GB"}, {"reserved": "513 MiB"}, {"memory_bandwidth": "404 GB/s"},
                                    {"zero_copy_read": None}, {"copy_latency": "11 us"}])
def test_fingerprint_changes_with_a_figure(tmp_path, change):
    original = load_profile(write(tmp_path, DOC, "a.yaml"))
    changed = load_profile(write(tmp_path, variant(**change), "b.yaml"))
    assert changed.fingerprint != original.fingerprint


def test_link_latencies_default_to_nothing_priced_and_keep_the_fingerprint_until_they_differ(tmp_path):
    original = load_profile(write(tmp_path, DOC, "a.yaml"))
    assert original.gpus[0].read_latency_s == original.gpus[0].zero_copy_latency_s == 0.0
    same = load_profile(write(tmp_path, variant(read_latency="0.7 us"), "b.yaml"))
    assert same.gpus[0].zero_copy_latency_s == same.gpus[0].read_latency_s == pytest.approx(0.7e-6)
    assert same.fingerprint == original.fingerprint
    measured = load_profile(write(tmp_path, variant(read_latency="0.7 us", zero_copy_latency="2.1 us"), "c.yaml"))
    assert measured.gpus[0].zero_copy_latency_s == pytest.approx(2.1e-6)
    assert measured.fingerprint != original.fingerprint


def test_fingerprint_changes_with_host(tmp_path):
    doc = copy.deepcopy(DOC)
    doc["host"]["pinned_budget"] = "40 GiB"
    assert load_profile(write(tmp_path, doc, "b.yaml")).fingerprint != load_profile(write(tmp_path, DOC)).fingerprint


@pytest.mark.parametrize("a, b", [("0.98 us", "980 ns"), ("1 us", "1000 ns"), ("10 us", "0.01 ms")])
def test_fingerprint_ignores_float_rounding_of_units(tmp_path, a, b):
    one = load_profile(write(tmp_path, variant(graph_node_overhead=a), "a.yaml"))
    other = load_profile(write(tmp_path, variant(graph_node_overhead=b), "b.yaml"))
    assert one.fingerprint == other.fingerprint


def test_with_vram_emulates_a_small_card():
    h200 = load_profile("h200-141g")
    small = h200.with_vram(8 * 2**30)
    gpu = small.gpus[0]
    assert gpu.vram_bytes == 8 * 2**30
    assert gpu.usable_bytes == 8 * 2**30 - h200.gpus[0].reserved_bytes
    assert gpu.host_to_device_bytes_per_s == h200.gpus[0].host_to_device_bytes_per_s
    assert small.fingerprint != h200.fingerprint


# --- kernel calibration -----------------------------------------------------------------------------------------

def test_kernel_calibration_reads_back_and_a_family_left_out_is_the_roofline(tmp_path, rng):
    efficiency, latency_us = round(float(rng.uniform(0.05, 1.0)), 3), round(float(rng.uniform(0.5, 20.0)), 2)
    calibrated = load_profile(write(tmp_path, variant(
        kernels={"decode_matmul": {"efficiency": efficiency, "latency": f"{latency_us} us"}}), "calibrated.yaml"))
    kernels = calibrated.gpus[0].kernels
    assert kernels.decode_matmul.efficiency == efficiency
    assert kernels.decode_matmul.latency_s == pytest.approx(latency_us * 1e-6)
    assert (kernels.decode_small.efficiency, kernels.decode_small.latency_s) == (1.0, 0.0)
    plain = load_profile(write(tmp_path, DOC, "plain.yaml"))
    roofline = load_profile(write(tmp_path, variant(kernels={"prefill_small": {"efficiency": 1, "latency": "0 us"}}),
                                  "roofline.yaml"))
    assert roofline.fingerprint == plain.fingerprint != calibrated.fingerprint


def test_an_l2_family_left_out_takes_its_decode_familys_fit(tmp_path, rng):
    """`decode_l2_*` (a model whose weights fit in `l2`) default to the `decode_*` fits, not the roofline; one
    given is its own; `l2` reads in bytes and defaults to none."""
    decode = {"efficiency": round(float(rng.uniform(0.05, 1.0)), 3), "latency": f"{rng.uniform(0.5, 20):.2f} us"}
    in_l2 = {"efficiency": 1.0, "latency": f"{rng.uniform(0.5, 5):.2f} us"}
    gpu = load_profile(write(tmp_path, variant(l2="48 MiB", kernels={
        "decode_matmul": decode, "decode_small": decode, "decode_l2_small": in_l2}))).gpus[0]
    assert gpu.l2_bytes == 48 << 20
    assert gpu.kernels.decode_l2_matmul == gpu.kernels.decode_matmul != KernelFit()
    assert gpu.kernels.decode_l2_small != gpu.kernels.decode_small
    assert gpu.kernels.decode_l2_small.latency_s == pytest.approx(float(in_l2["latency"].split()[0]) * 1e-6)
    assert load_profile(write(tmp_path, DOC, "plain.yaml")).gpus[0].l2_bytes == 0


def test_fp16_defaults_to_fp32(tmp_path):
    gpu = load_profile(write(tmp_path, variant(fp16=None))).gpus[0]
    assert gpu.fp16_flops == gpu.fp32_flops


@pytest.mark.parametrize("kernels, field, says", [
    ({"decode_matmul": {"efficiency": 0}}, "kernels.decode_matmul.efficiency", "(0, 1]"),
    ({"decode_matmul": {"efficiency": 1.5}}, "kernels.decode_matmul.efficiency", "(0, 1]"),
    ({"decode_matmul": {"efficiency": "fast"}}, "kernels.decode_matmul.efficiency", "(0, 1]"),
    ({"decode_matmull": {"efficiency": 0.5}}, "kernels.decode_matmull", "unknown field"),
    ({"decode_small": {"latency": 4}}, "kernels.decode_small.latency", "duration"),
    ({"prefill_small": 0.5}, "kernels.prefill_small", "mapping"),
    ({"prefill_matmul": {"further_tile": 0}}, "kernels.prefill_matmul.further_tile", "(0, 1]"),
    ({"prefill_experts": {"weight_element": 0.3}}, "kernels.prefill_experts.weight_element", "no unit"),
    ({"decode_matmul": {"further_tile": 0.8}}, "kernels.decode_matmul.further_tile", "unknown field"),
    ({"decode_attention": {"walk_token": "0.2 us"}}, "kernels.decode_attention.walk_token", "unknown field"),
    ({"prefill_attention": {"walk_token": 2e-7}}, "kernels.prefill_attention.walk_token", "no unit"),
])
def test_bad_kernel_calibration_is_refused(tmp_path, kernels, field, says):
    message = refused(write(tmp_path, variant(kernels=kernels)))
    assert field in message and says in message


def test_slower_kernels_predict_slower_decode(tmp_path):
    """The cost model prices what the profile's calibration says: a decode matmul at half the roofline plus
    20 us a kernel predicts slower decode than the roofline, and nothing else of the plan's sizing changes."""
    from planner.search import solve

    plain = write(tmp_path, DOC, "plain.yaml")
    slow = write(tmp_path, variant(kernels={"decode_matmul": {"efficiency": 0.5, "latency": "20 us"}}), "slow.yaml")
    fast_plan, slow_plan = (solve(path, "qwen3-30b-a3b-q8_0", context=4096) for path in (plain, slow))
    fast_decode, slow_decode = ([row["tok_s"] for row in plan.predictions["decode"]] for plan in (fast_plan, slow_plan))
    assert all(slow < fast for slow, fast in zip(slow_decode, fast_decode, strict=True))
    assert slow_plan.predictions["prefill"] == fast_plan.predictions["prefill"]


def test_decode_weight_rates_read_back_and_keep_the_fingerprint_until_measured(tmp_path):
    original = load_profile(write(tmp_path, DOC, "a.yaml"))
    assert original.gpus[0].decode_weight_rate("Q4_K") == 1.0
    rated = load_profile(write(tmp_path, variant(decode_weight_rates={"q4_k": 0.42, "Q6_K": 0.31}), "b.yaml"))
    gpu = rated.gpus[0]
    assert (gpu.decode_weight_rate("Q4_K"), gpu.decode_weight_rate("Q6_K"), gpu.decode_weight_rate("Q8_0")) == (
        0.42, 0.31, 1.0)
    assert rated.fingerprint != original.fingerprint
    assert load_profile(write(tmp_path, variant(decode_weight_rates={}), "c.yaml")).fingerprint == original.fingerprint


@pytest.mark.parametrize("rates, field, says", [
    ({"Q4_K": 0}, "decode_weight_rates.Q4_K", "(0, 4]"),
    ({"Q4_K": "slow"}, "decode_weight_rates.Q4_K", "(0, 4]"),
    ({"Q4_KM": 0.4}, "decode_weight_rates.Q4_KM", "not a GGML type name"),
    ([0.4], "decode_weight_rates", "mapping of GGML type names"),
])
def test_bad_decode_weight_rates_are_refused(tmp_path, rates, field, says):
    message = refused(write(tmp_path, variant(decode_weight_rates=rates)))
    assert field in message and says in message


def test_a_slower_weight_type_predicts_slower_decode_by_its_bytes_share(tmp_path):
    """A Q4_K_M card's decode at a rate of 0.4 for Q4_K (and 0.3 for Q6_K) is slower than at Q8_0's rate; a
    rate for a type the card does not hold changes nothing; prefill is unchanged (the rates are the decode
    family's)."""
    from planner.search import solve

    plain = write(tmp_path, DOC, "plain.yaml")
    slow = write(tmp_path, variant(decode_weight_rates={"Q4_K": 0.4, "Q6_K": 0.3}), "slow.yaml")
    other = write(tmp_path, variant(decode_weight_rates={"Q4_0": 0.5}), "other.yaml")
    plans = [solve(path, "qwen3-30b-a3b-q4_k_m", context=4096) for path in (plain, slow, other)]
    decode = [[row["tok_s"] for row in plan.predictions["decode"]] for plan in plans]
    assert all(s < f for s, f in zip(decode[1], decode[0], strict=True))
    assert decode[2] == decode[0]
    assert plans[1].predictions["prefill"] == plans[0].predictions["prefill"]
