"""The demo model (tools/demo.py, trained by tools/train_demo.py): its export is a GGUF the planner plans with its
drafter and the reference runs; `stratum run --prompt` takes and prints text for a byte-level vocabulary only,
and solves its own plan; the trainer's torch forward pass is the reference's (where torch is installed); the
committed demo model has learned (where it is committed)."""

import math

import numpy as np
import pytest
from gguf import GGUFReader

from planner import vocab
from planner.architecture import tensor_layout, tensor_role
from planner.cli import main
from planner.errors import StratumError
from planner.header import read_header
from planner.plan import load_plan
from planner.profile import profile_for_gpu
from runtime import reference
from runtime.synthetic import write_model
from tools import demo


def random_tensors(hp, rng) -> dict:
    """float32 values for every tensor of hp's layout that keep activations O(1): matrices normal(0,
    1/sqrt(fan_in)), norms near 1, biases (exp_probs_b too) small."""
    tensors = {}
    for name, gguf_shape in tensor_layout(hp):
        shape, role = tuple(reversed(gguf_shape)), tensor_role(name)
        if role.endswith("norm"):
            values = 1 + 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:
            values = 0.1 * rng.standard_normal(shape)
        else:
            values = rng.standard_normal(shape) / math.sqrt(shape[-1])
        tensors[name] = values.astype(np.float32)
    return tensors


def tiny_demo(path, rng):
    return demo.export(path, random_tensors(demo.hparams(demo.TINY_SHAPE), rng), demo.TINY_SHAPE, 256, "test")


def relative_l2(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_the_demo_export_plans_with_its_drafter_and_runs_in_the_reference(tmp_path, rng):
    hp = demo.hparams(demo.SHAPE)
    tensors = random_tensors(hp, rng)
    assert 20e6 < sum(values.size for values in tensors.values()) < 25e6
    path = demo.export(tmp_path / "demo.gguf", tensors, demo.SHAPE, 1024, "random weights")
    assert path.stat().st_size < 30e6
    header = read_header(path)
    assert header.metadata[vocab.TOKENIZER_MODEL_KEY] == vocab.BYTE_TOKENIZER
    assert header.metadata["glm4moe.context_length"] == 1024
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert types["blk.1.ffn_down_exps.weight"] == types["blk.0.attn_q.weight"] == types["output.weight"] == "Q8_0"
    assert types["blk.1.exp_probs_b.bias"] == types["blk.1.ffn_gate_inp.weight"] == types["blk.0.attn_norm.weight"]
    assert types["blk.0.attn_norm.weight"] == "F32"
    plan_path = tmp_path / "plan.yaml"
    assert main(["plan", "--hardware", "h200-141g", "--model", str(path), "--mtp", "-o", str(plan_path)]) == 0
    plan = load_plan(plan_path, model=str(path))
    assert plan.settings["mtp"] and plan.knobs["draft_depth"] > 0
    ids = np.frombuffer(b"def f(x):\n    return x", dtype=np.uint8)
    logits, drafts = reference.forward(path, ids), reference.nextn_forward(path, ids)
    assert logits.shape == (len(ids), 256) and drafts.shape == (len(ids) - 1, 256)
    assert np.all(np.isfinite(logits)) and np.all(np.isfinite(drafts))
    # the exported values are the given ones, rounded through Q8_0
    weights = reference.load(path).weights
    assert relative_l2(weights["blk.2.ffn_up_exps.weight"], tensors["blk.2.ffn_up_exps.weight"]) < 1e-2
    assert np.array_equal(weights["blk.2.exp_probs_b.bias"], tensors["blk.2.exp_probs_b.bias"])


def test_the_export_refuses_tensors_that_are_not_the_layout(tmp_path, rng):
    tensors = random_tensors(demo.hparams(demo.TINY_SHAPE), rng)
    with pytest.raises(StratumError, match="blk.0.attn_q.weight.*missing"):
        demo.export(tmp_path / "x.gguf", {k: v for k, v in tensors.items() if k != "blk.0.attn_q.weight"},
                    demo.TINY_SHAPE, 256, "test")
    with pytest.raises(StratumError, match="has shape"):
        demo.export(tmp_path / "x.gguf", {**tensors, "output.weight": tensors["output.weight"].T},
                    demo.TINY_SHAPE, 256, "test")
    assert not (tmp_path / "x.gguf").exists()


def test_held_out_files_are_about_one_in_fifty_and_never_trained_on():
    training, held_out = demo.library_files()
    assert held_out and not set(training) & set(held_out)
    assert 0.01 < len(held_out) / (len(training) + len(held_out)) < 0.04
    assert len(demo.held_out_text(256)) == 256


def test_text_is_its_utf8_bytes_and_decodes_as_it_streams():
    ids = vocab.encode("déf π")
    assert ids == list("déf π".encode()) and max(ids) < vocab.BYTE_VOCAB_SIZE
    assert vocab.decode(ids) == "déf π"
    decoder = vocab.text_decoder()
    pieces = [decoder.decode(bytes([token])) for token in ids]
    assert pieces[1:3] == ["", "é"] and "".join(pieces) == "déf π"     # é is two bytes: out once whole
    assert vocab.decode([0x66, 0xFF, 0x66]) == "f\ufffdf"


def test_prompt_text_is_refused_for_a_model_without_a_byte_vocabulary(tmp_path, capsys):
    model = write_model(tmp_path / "qwen.gguf", "qwen3moe", seed=1)
    assert main(["run", "--model", str(model), "--hardware", "h200-141g", "--prompt", "def "]) == 2
    err = capsys.readouterr().err
    assert "--prompt needs a byte-level vocabulary" in err and "--prompt-ids" in err
    assert len(err.strip().splitlines()) == 1


def test_run_without_a_plan_takes_the_profile_of_this_gpu(tmp_path, rng, capsys):
    assert profile_for_gpu("NVIDIA H200") == "h200-141g" == profile_for_gpu("nvidia h200")
    model = tiny_demo(tmp_path / "tiny.gguf", rng)
    assert main(["run", "--model", str(model), "--prompt", "def "]) == 2     # the simulator is no bundled GPU
    err = capsys.readouterr().err
    assert "no bundled hardware profile is for this GPU" in err and "h200-141g, rtx-2060-super-8g" in err


class RecordingEngine:
    """What `stratum run` uses of runtime.engine.Engine, streaming set bytes: the engine's own tokens are
    tests/test_engine.py's to check (a simulated engine takes a minute to start), what is printed this file's."""
    runs = []
    startup_s = 0.0
    TOKENS = [*"é".encode(), 0xFF, *b"ok"]       # a character in two tokens, a byte that is no UTF-8

    def __init__(self, plan, model, progress, seed):
        self.plan = plan
        RecordingEngine.runs.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def stream(self, prompt, max_new_tokens, temperature, stop_ids, draft_depth):
        self.prompt = prompt
        yield from self.TOKENS[:max_new_tokens]

    def stats(self) -> dict:
        return {"last_request": {}}


def test_stratum_run_prints_the_new_text_of_a_byte_model(tmp_path, rng, capsys, monkeypatch):
    """--prompt's bytes go in; the new bytes come out as text, decoded as they stream; the plan is solved for
    --hardware with the shortest context the planner takes that holds the prompt and the new tokens."""
    monkeypatch.setattr("runtime.commands.Engine", RecordingEngine)
    model = tiny_demo(tmp_path / "tiny.gguf", rng)
    capsys.readouterr()         # the seed line
    assert main(["run", "--model", str(model), "--hardware", "h200-141g", "--prompt", "de", "--max-new-tokens", "4",
                 "--quiet"]) == 0
    assert capsys.readouterr().out == "é\ufffdo\n"
    engine = RecordingEngine.runs[-1]
    assert engine.prompt == [ord("d"), ord("e")]
    assert engine.plan.profile["name"] == "h200-141g" and engine.plan.settings["context_tokens"] == 128


@pytest.mark.parametrize("shape", [demo.TINY_SHAPE, demo.SHAPE], ids=["tiny", "demo"])
def test_the_trainers_forward_pass_is_the_references(tmp_path, rng, shape):
    """tools/train_demo.py's torch forward pass, over the tensors of its own layout exported as F32, against
    runtime.reference from the file: logits, NextN logits and routes, in float64 and float32 (measured: 7e-8
    and 1e-6 relative L2, the float64 figure the reference's rounding of K/V to float32)."""
    torch = pytest.importorskip("torch")
    from tools import train_demo
    hp = demo.hparams(shape)
    params = train_demo.init_params(hp, seed=0, device="cpu")
    tensors = random_tensors(hp, rng)
    assert set(params) == set(tensors) and all(params[n].shape == tensors[n].shape for n in params)
    path = demo.export(tmp_path / "f32.gguf", tensors, shape, 256, "test", types={})
    ids = rng.integers(0, 256, 40)
    want, want_drafts = reference.forward(path, ids), reference.nextn_forward(path, ids)
    want_routes = reference.routing(path, ids)
    for dtype, tolerance in ((torch.float64, 1e-6), (torch.float32, 1e-4)):
        weights = {name: torch.tensor(values, dtype=dtype) for name, values in tensors.items()}
        tokens = torch.tensor(ids)[None]
        routes = {}
        with torch.no_grad():
            logits, hidden = train_demo.forward(weights, hp, tokens, routes)
            drafts = train_demo.nextn_forward(weights, hp, tokens[:, 1:], hidden[:, :-1])
        got, got_drafts = logits[0].double().numpy(), drafts[0].double().numpy()
        print(dtype, relative_l2(got, want), relative_l2(got_drafts, want_drafts))
        assert relative_l2(got, want) < tolerance and relative_l2(got_drafts, want_drafts) < tolerance
        assert set(routes) == set(want_routes)
        for layer, chosen in routes.items():
            assert np.array_equal(np.sort(chosen[0].numpy(), axis=1), np.sort(want_routes[layer], axis=1)), layer


def test_the_trainer_runs_on_the_cpu_and_writes_a_byte_model(tmp_path, capsys):
    pytest.importorskip("torch")
    from tools import train_demo
    out = tmp_path / "tiny.gguf"
    train_demo.main(["--device", "cpu", "--tiny", "--steps", "2", "--batch", "2", "--seq-len", "64",
                     "--eval-bytes", "128", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "held out:" in printed and "runtime.reference on the file" in printed and f"wrote {out.resolve()}" in printed
    assert read_header(out).metadata[vocab.TOKENIZER_MODEL_KEY] == vocab.BYTE_TOKENIZER


@pytest.mark.skipif(not demo.DEMO_PATH.exists(), reason="no trained demo model committed")
def test_the_committed_demo_model_has_learned_python():
    """On held-out standard library source, the reference from the committed file: the trunk needs far fewer
    than the uniform 8 bits per byte, and the NextN block's top-1 accuracy beats always drafting the snippet's
    most common byte (what an untrained model would at best do) by a margin."""
    text = demo.held_out_text(256)
    measured = demo.reference_measures(demo.DEMO_PATH, text)
    print(measured)
    assert measured["bits_per_byte"] < 4.0
    most_common_share = np.bincount(np.frombuffer(text, dtype=np.uint8)).max() / len(text)
    assert measured["nextn_top1"] > most_common_share + 0.1
