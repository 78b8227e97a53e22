"""The command line: every command works, bad input is one line and exit code 2, generated plans are current."""

import subprocess
import sys

import pytest
import yaml

from planner.cli import main
from planner.generate import generated_files
from plans import GENERATED_DIR, HARDWARE_DIR, MODELS_DIR
from tests.ggufs import write_header_only


def run(*args):
    return subprocess.run([sys.executable, "-m", "planner.cli", *map(str, args)], capture_output=True, text=True)


def test_plan_show_explain_diff_and_svg(tmp_path, capsys):
    a, b = tmp_path / "a.yaml", tmp_path / "b.json"
    common = ["plan", "--hardware", "rtx-2060-super-8g", "--model", "glm-4.5-air-q4_k_m", "--context", "32768"]
    assert main([*common, "--kv", "q8_0", "--mtp", "-o", str(a)]) == 0
    assert main([*common, "--kv", "k8v4", "--no-mtp", "--prompt-tokens", "2048", "--skew", "0.5", "-o", str(b)]) == 0
    assert main(["show", str(a)]) == 0
    assert "prefill_ring" in capsys.readouterr().out
    assert main(["explain", str(a)]) == 0
    assert "room_min_read_tokens" in capsys.readouterr().out
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "drafter_experts" in out and "k8v4" in out
    assert main(["show", str(a), "--svg", str(tmp_path / "a.svg")]) == 0
    assert "<svg" in (tmp_path / "a.svg").read_text()
    assert main(["profiles"]) == 0 and "rtx-2060-super-8g" in capsys.readouterr().out
    assert main(["models"]) == 0 and "glm-4.5-air-q4_k_m" in capsys.readouterr().out


def test_plan_as_json_on_stdout(capsys):
    assert main(["plan", "--hardware", "h200-141g", "--model", "qwen3-30b-a3b-q8_0", "--json"]) == 0
    assert '"schema": "stratum-plan/3"' in capsys.readouterr().out


def truncated_gguf(tmp_path):
    path = tmp_path / "cut.gguf"
    write_header_only(MODELS_DIR / "qwen3-30b-a3b-q8_0.yaml", path)
    path.write_bytes(path.read_bytes()[:5000])
    return path


def bad_magic(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    return path


def unknown_type(tmp_path):
    path = tmp_path / "type.gguf"
    write_header_only(MODELS_DIR / "qwen3-30b-a3b-q8_0.yaml", path)
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    data[at + 4 + 8 * n_dims:at + 8 + 8 * n_dims] = (77).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path


def profile_without(tmp_path, field):
    document = yaml.safe_load((HARDWARE_DIR / "rtx-3090-24g.yaml").read_text())
    del document["gpus"][0][field]
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def profile_with(tmp_path, field, value):
    document = yaml.safe_load((HARDWARE_DIR / "rtx-3090-24g.yaml").read_text())
    document["gpus"][0][field] = value
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.mark.parametrize("make_args, message", [
    (lambda t: ["--model", truncated_gguf(t)], "truncated GGUF header"),
    (lambda t: ["--model", bad_magic(t)], "not a GGUF file"),
    (lambda t: ["--model", unknown_type(t)], "unknown ggml type 77"),
    (lambda t: ["--model", "qwen3-30b-a3b-q8_0", "--hardware", profile_without(t, "memory_bandwidth")],
     "gpus[0].memory_bandwidth: missing"),
    (lambda t: ["--model", "qwen3-30b-a3b-q8_0", "--hardware", profile_with(t, "vram", "-24 GiB")],
     "gpus[0].vram: '-24 GiB' is negative"),
    (lambda t: ["--model", "qwen3-30b-a3b-q8_0", "--hardware", profile_with(t, "vram", 24)],
     "gpus[0].vram: 24 has no unit"),
    (lambda t: ["--model", "glm-4.5-q4_k_m", "--hardware", "rtx-2060-super-8g"], "does not fit"),
    (lambda t: ["--model", "qwen3-30b-a3b-q8_0", "--kv", "q3"], "unknown K/V type"),
    (lambda t: ["--model", "qwen3-30b-a3b-q8_0", "--context", "1000000"], "exceeds the model's trained context"),
])
def test_bad_input_is_one_line_exit_two_no_traceback(tmp_path, make_args, message):
    args = make_args(tmp_path)
    if "--hardware" not in args:
        args += ["--hardware", "rtx-3090-24g"]
    result = run("plan", *args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert message in result.stderr


def test_a_plan_for_another_model_is_refused(tmp_path):
    plan = tmp_path / "plan.yaml"
    assert main(["plan", "--hardware", "rtx-3090-24g", "--model", "qwen3-30b-a3b-q8_0", "-o", str(plan)]) == 0
    result = run("show", plan, "--model", "qwen3-30b-a3b-q4_k_m")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "made for model 'qwen3-30b-a3b-q8_0'" in result.stderr and "total_bytes" in result.stderr


def test_generated_plans_are_current():
    files = generated_files()
    for relative, text in files.items():
        path = GENERATED_DIR / relative
        assert path.exists(), f"{relative} is missing: run `stratum generate`"
        assert path.read_text() == text, f"{relative} is stale: run `stratum generate`"
    on_disk = {str(p.relative_to(GENERATED_DIR)) for p in GENERATED_DIR.glob("*/*.yaml")}
    assert on_disk == {r for r in files if r.endswith(".yaml")}


def test_planning_imports_no_numba(tmp_path):
    """`stratum plan` must stay a sub-second process: the planning path never loads the kernel compiler."""
    code = ("import sys; from planner.cli import main; "
            f"main(['plan', '--hardware', 'rtx-2060-super-8g', '--model', 'glm-4.5-air-q4_k_m', '-o', "
            f"'{tmp_path / 'p.yaml'}']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'numba_cuda', 'llvmlite')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_profile_detect_without_a_gpu_refuses_in_one_line_and_writes_nothing(tmp_path):
    """CI has no GPU (the simulator is not one): the detect refuses before measuring, with its reason."""
    profile, samples = tmp_path / "p.yaml", tmp_path / "samples.json"
    result = run("profile", "--detect", "-o", profile, "--samples", samples)
    assert result.returncode == 2
    assert "--detect measures a real NVIDIA GPU" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not profile.exists() and not samples.exists()
