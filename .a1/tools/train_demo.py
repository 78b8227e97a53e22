"""Train the demo model (tools/demo.py) on the Python standard library's source with torch, and export it to GGUF.

On the H200, one command (240 s of training, then evaluation, export and the reference's check; a 25.1 MB
file; the committed one was made so):

    python3 tools/train_demo.py --out plans/demo/stratum-demo.gguf --seconds 240

A smoke test on the CPU: python3 tools/train_demo.py --device cpu --steps 5 --tiny --out /tmp/tiny.gguf

The forward pass is runtime/reference.py's, written in torch over the same tensors (named as in the GGUF, in
numpy order: export is a copy); tests/test_demo.py checks that the two compute the same function. The trunk
learns the next byte; the NextN block learns the byte after it from [enorm(embed(next byte)) ; hnorm(trunk's
hidden state)] (the MTP loss, weighted --mtp-weight). Routed experts are computed densely, every expert on every
token weighted 0 where it is not chosen: the same function as top-k dispatch, and at this size the fastest.
exp_probs_b is no parameter of the loss: after each step an aux-loss-free balancing rule (DeepSeek-V3's) moves
it, but only for experts whose load in the batch is outside [mean / band, mean * band], so routing keeps a skew
and no expert dies. On CUDA matrices run in bf16 under autocast; norms, routers, the residual stream and the
losses stay float32.

At the end it prints the held-out bits per byte, the NextN block's top-1 accuracy and its agreement with the
trunk's greedy choice (a depth-1 draft's acceptance), the routing skew (the share of routed slots the top
quarter of the experts takes), a greedy sample, where the file went and its size, and the same measures by
runtime.reference from the written file on a held-out snippet.
"""

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # the project's packages, from any folder

from planner import vocab                                         # noqa: E402
from planner.architecture import tensor_layout, tensor_role       # noqa: E402
from runtime.synthetic import top_quarter_share                  # noqa: E402
from tools import demo                                           # noqa: E402

INIT_STD = 0.02
_RESIDUAL_WRITERS = {"attn_output", "ffn_down", "ffn_down_shexp", "ffn_down_exps"}   # init scaled by depth
NOT_TRAINED = "exp_probs_b.bias"        # moved by the balancing rule, not by gradients
SAMPLE_PROMPT = b"def "


# ---- the forward pass: runtime/reference.py's, batched: x (batch, tokens, n_embd) at positions 0..tokens-1 ----

def _wide(x):
    """At least float32 (bf16 under autocast widened; float64 kept, as the tests run)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rmsnorm(x, weight, eps: float):
    x = _wide(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def linear(params: dict, name: str, x):
    return F.linear(x, params[name + ".weight"], params.get(name + ".bias"))


def rope_neox(x, n_heads: int, n_rot: int, base: float):
    """NEOX RoPE on the first n_rot dims of each head: pairs (i, i + n_rot/2), theta = pos * base^(-2i/n_rot)."""
    x = _wide(x)
    heads = x.unflatten(-1, (n_heads, -1))
    half = n_rot // 2
    positions = torch.arange(x.shape[1], dtype=torch.float64, device=x.device)
    theta = positions[:, None] * base ** (-2.0 * torch.arange(half, dtype=torch.float64, device=x.device) / n_rot)
    cos, sin = theta.cos().to(x.dtype)[:, None, :], theta.sin().to(x.dtype)[:, None, :]
    x0, x1 = heads[..., :half], heads[..., half:n_rot]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos, heads[..., n_rot:]], dim=-1).flatten(-2)


def attention(q, k, v, hp):
    """Causal GQA, scale 1/sqrt(head_dim): query head h reads K/V head h // (n_head / n_head_kv)."""
    group = hp.n_head // hp.n_head_kv
    q = q.unflatten(-1, (hp.n_head, -1)).transpose(1, 2)
    k, v = (t.unflatten(-1, (hp.n_head_kv, -1)).transpose(1, 2).repeat_interleave(group, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2)


def swiglu_ffn(params: dict, p: str, h, suffix: str):
    gate, up = (linear(params, f"{p}ffn_{role}{suffix}", h) for role in ("gate", "up"))
    return linear(params, f"{p}ffn_down{suffix}", F.silu(gate) * up)


def routed_experts(params: dict, hp, layer: int, h, routes: dict | None):
    """Sigmoid routing: experts chosen on sigmoid + exp_probs_b, weighted by the unbiased sigmoid (renormalised,
    scaled); every expert computed, weighted 0 where not chosen."""
    p = f"blk.{layer}."
    router = params[p + "ffn_gate_inp.weight"]
    with torch.autocast(h.device.type, enabled=False):         # the router is F32 in the file
        probs = torch.sigmoid(F.linear(h.to(router.dtype), router))
    ids = torch.topk(probs + params[p + "exp_probs_b.bias"], hp.n_expert_used, dim=-1).indices
    weights = probs.gather(-1, ids)
    if hp.expert_weights_norm:
        weights = weights / weights.sum(-1, keepdim=True)
    if routes is not None:
        routes[layer] = ids
    gate_exps, up_exps, down_exps = (params[p + role + ".weight"]
                                     for role in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    n_expert, n_ff, n_embd = gate_exps.shape
    gate = F.linear(h, gate_exps.reshape(n_expert * n_ff, n_embd)).unflatten(-1, (n_expert, n_ff))
    up = F.linear(h, up_exps.reshape(n_expert * n_ff, n_embd)).unflatten(-1, (n_expert, n_ff))
    scale = torch.zeros_like(probs).scatter(-1, ids, weights * hp.expert_weights_scale).to(gate.dtype)
    hidden = (F.silu(gate) * up * scale[..., None]).flatten(-2)
    return F.linear(hidden, down_exps.permute(1, 0, 2).reshape(n_embd, n_expert * n_ff))


def block(params: dict, hp, layer: int, x, routes: dict | None = None):
    """One block (glm4moe has no q/k norms in its layout): attention, then the FFN on post_attention_norm(x)."""
    p = f"blk.{layer}."
    h = rmsnorm(x, params[p + "attn_norm.weight"], hp.rms_eps)
    q, k, v = (linear(params, p + name, h) for name in ("attn_q", "attn_k", "attn_v"))
    q, k = rope_neox(q, hp.n_head, hp.n_rot, hp.rope_base), rope_neox(k, hp.n_head_kv, hp.n_rot, hp.rope_base)
    x = x + linear(params, p + "attn_output", attention(q, k, v, hp))
    h = rmsnorm(x, params[p + "post_attention_norm.weight"], hp.rms_eps)
    if not hp.is_moe_layer(layer):
        return x + swiglu_ffn(params, p, h, "")
    ffn = routed_experts(params, hp, layer, h, routes)
    if p + "ffn_up_shexp.weight" in params:
        ffn = ffn + swiglu_ffn(params, p, h, "_shexp")
    return x + ffn


def forward(params: dict, hp, tokens, routes: dict | None = None):
    """(logits, hidden): the trunk's logits at every position and its hidden state after output_norm."""
    x = params["token_embd.weight"][tokens]
    for layer in range(hp.n_trunk):
        x = block(params, hp, layer, x, routes)
    hidden = rmsnorm(x, params["output_norm.weight"], hp.rms_eps)
    return F.linear(hidden, params["output.weight"]), hidden


def nextn_forward(params: dict, hp, next_tokens, hidden, routes: dict | None = None):
    """The NextN block's logits: row i reads the token at i + 1 and the trunk's hidden state at i."""
    layer, eps = hp.n_trunk, hp.rms_eps
    p = f"blk.{layer}.nextn."
    embedded = rmsnorm(params["token_embd.weight"][next_tokens], params[p + "enorm.weight"], eps)
    previous = rmsnorm(hidden, params[p + "hnorm.weight"], eps)
    x = block(params, hp, layer, linear(params, p + "eh_proj", torch.cat([embedded, previous], dim=-1)), routes)
    return F.linear(rmsnorm(x, params[p + "shared_head_norm.weight"], eps), params["output.weight"])


# ---- training ----

def init_params(hp, seed: int, device) -> dict:
    """Every tensor of the layout, numpy order: norms 1, biases 0, matrices normal(0, INIT_STD), those writing
    the residual stream scaled down by sqrt(2 * blocks)."""
    generator = torch.Generator().manual_seed(seed)
    params = {}
    for name, gguf_shape in tensor_layout(hp):
        shape, role = tuple(reversed(gguf_shape)), tensor_role(name)
        if role.endswith("norm"):
            value = torch.ones(shape)
        elif len(shape) == 1:
            value = torch.zeros(shape)
        else:
            std = INIT_STD / math.sqrt(2 * hp.n_layer) if role in _RESIDUAL_WRITERS else INIT_STD
            value = torch.randn(shape, generator=generator) * std
        params[name] = value.to(device).requires_grad_(role != NOT_TRAINED)
    return params


def losses(params: dict, hp, windows, routes: dict | None = None):
    """(trunk loss, MTP loss), nats per byte, over windows (batch, tokens + 2) of bytes."""
    logits, hidden = forward(params, hp, windows[:, :-2], routes)
    drafts = nextn_forward(params, hp, windows[:, 1:-1], hidden, routes)
    trunk = F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:-1].flatten())
    return trunk, F.cross_entropy(drafts.float().flatten(0, 1), windows[:, 2:].flatten())


@torch.no_grad()
def balance(params: dict, hp, routes: dict, rate: float, band: float) -> None:
    """Aux-loss-free load balancing outside a band: an expert chosen more than band x the mean load of its
    block in this batch is made less likely to be chosen (its bias - rate), one chosen less than mean / band
    more likely (+ rate)."""
    for layer, ids in routes.items():
        chosen = ids.flatten()      # counted by index_add: bincount would wait for the GPU
        load = torch.zeros(hp.n_expert, device=ids.device).index_add_(0, chosen, torch.ones(chosen.shape,
                                                                                           device=ids.device))
        mean = load.mean()
        params[f"blk.{layer}.exp_probs_b.bias"] += rate * ((load < mean / band).float() - (load > mean * band).float())


def learning_rate(args, step: int, progress: float) -> float:
    """Linear warm-up, then a cosine from --lr to a tenth of it over the run's progress (steps or seconds)."""
    warm = min(1.0, (step + 1) / args.warmup_steps)
    return args.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def mixed_precision(device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def windows_at(data, starts, n_bytes: int):
    """The n_bytes of data from each start, as token ids (len(starts), n_bytes)."""
    return data[starts[:, None] + torch.arange(n_bytes, device=data.device)].long()


def train(args, hp, params: dict, data) -> tuple[int, float]:
    """Train until --steps or --seconds; returns (steps, seconds)."""
    trained = [t for t in params.values() if t.requires_grad]
    groups = [{"params": [t for t in trained if t.ndim > 1], "weight_decay": args.weight_decay},
              {"params": [t for t in trained if t.ndim == 1], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=data.is_cuda)
    generator = torch.Generator(device=data.device).manual_seed(args.seed)
    started, step, tokens = time.perf_counter(), 0, args.batch * args.seq_len
    while True:
        elapsed = time.perf_counter() - started
        progress = max(step / args.steps if args.steps else 0.0, elapsed / args.seconds if args.seconds else 0.0)
        if progress >= 1.0:
            return step, elapsed
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args, step, progress)
        starts = torch.randint(0, len(data) - args.seq_len - 2, (args.batch,), device=data.device,
                               generator=generator)
        routes = {}
        with mixed_precision(data.device):
            trunk, mtp = losses(params, hp, windows_at(data, starts, args.seq_len + 2), routes)
        optimizer.zero_grad(set_to_none=True)
        (trunk + args.mtp_weight * mtp).backward()
        torch.nn.utils.clip_grad_norm_(trained, args.clip)
        optimizer.step()
        balance(params, hp, routes, args.bias_rate, args.band)
        step += 1
        if step % args.log_every == 0 or step == 1:
            if data.is_cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
            print(f"step {step:6d}  {elapsed:7.1f} s  loss {trunk.item():.4f}  mtp loss {mtp.item():.4f}  "
                  f"{step * tokens / elapsed:10.0f} tok/s  lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)


@torch.no_grad()
def evaluate(args, hp, params: dict, data) -> dict:
    """demo.measures over --eval-bytes of held-out text (windows of --seq-len, evenly spaced, each measured as
    a text of its own), and each MoE block's top-quarter share of the routed slots."""
    n_windows = max(1, args.eval_bytes // args.seq_len)
    starts = torch.linspace(0, len(data) - args.seq_len, n_windows, device=data.device).long()
    logits, drafts, texts, routes = [], [], [], {}
    for first in range(0, n_windows, args.batch):
        windows = windows_at(data, starts[first:first + args.batch], args.seq_len)
        batch_routes = {}
        with mixed_precision(data.device):
            trunk_logits, hidden = forward(params, hp, windows, batch_routes)
            draft_logits = nextn_forward(params, hp, windows[:, 1:], hidden[:, :-1], batch_routes)
        logits.append(trunk_logits.float().cpu().numpy())
        drafts.append(draft_logits.float().cpu().numpy())
        texts.append(windows.cpu().numpy())
        for layer, chosen in batch_routes.items():
            routes.setdefault(layer, []).append(chosen.cpu().numpy())
    per_window = [demo.measures(*text) for text in
                  zip(np.concatenate(logits), np.concatenate(drafts), np.concatenate(texts))]
    result = {key: float(np.mean([m[key] for m in per_window])) for key in per_window[0]}
    result["top_quarter_share"] = {layer: top_quarter_share(np.concatenate(chosen), hp.n_expert)
                                   for layer, chosen in sorted(routes.items())}
    return result


@torch.no_grad()
def sample(params: dict, hp, prompt: bytes, n_bytes: int, device) -> bytes:
    """Greedy bytes after `prompt`, recomputing the whole text each step."""
    ids = list(prompt)
    for _ in range(n_bytes):
        with mixed_precision(device):
            logits, _ = forward(params, hp, torch.tensor([ids], device=device))
        ids.append(int(logits[0, -1].argmax()))
    return bytes(ids[len(prompt):])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(demo.DEMO_PATH), help="the GGUF to write (default: %(default)s)")
    parser.add_argument("--steps", type=int, help="stop after this many steps")
    parser.add_argument("--seconds", type=float, default=300.0, help="stop after this wall time (default 300)")
    parser.add_argument("--batch", type=int, default=32, help="windows per step (default 32)")
    parser.add_argument("--seq-len", type=int, default=1024, help="bytes per window, the model's context (1024)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="runtime.synthetic's tiny glm4moe shape (smoke tests)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    parser.add_argument("--mtp-weight", type=float, default=0.3, help="the NextN (MTP) loss's weight")
    parser.add_argument("--bias-rate", type=float, default=1e-3, help="exp_probs_b step of the balancing rule")
    parser.add_argument("--band", type=float, default=2.0, help="loads within [mean / band, mean * band] are left")
    parser.add_argument("--eval-bytes", type=int, default=1 << 16, help="held-out bytes evaluated (default 65536)")
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args(argv)
    if not args.steps and not args.seconds:
        parser.error("give --steps or --seconds")

    device = torch.device(args.device)
    shape = demo.TINY_SHAPE if args.tiny else demo.SHAPE
    hp = demo.hparams(shape)
    training_files, held_out_files = demo.library_files()
    training, held_out = (torch.frombuffer(bytearray(demo.read_files(files)), dtype=torch.uint8).to(device)
                          for files in (training_files, held_out_files))
    params = init_params(hp, args.seed, device)
    n_params = sum(t.numel() for t in params.values())
    print(f"{n_params / 1e6:.2f}M parameters; training on {len(training) / 1e6:.1f} MB of {len(training_files)} "
          f"files, {len(held_out_files)} files ({len(held_out) / 1e6:.2f} MB) held out; {device}", flush=True)

    steps, seconds = train(args, hp, params, training)
    result = evaluate(args, hp, params, held_out)
    shares = result["top_quarter_share"]
    summary = (f"held out: {result['bits_per_byte']:.3f} bits per byte, NextN top-1 {result['nextn_top1']:.3f}, "
               f"draft agreement with the trunk {result['draft_agreement']:.3f}; the top quarter of the experts "
               f"takes {np.mean(list(shares.values())):.3f} of the routed slots")
    print(f"trained {steps} steps in {seconds:.0f} s ({steps * args.batch * args.seq_len / 1e6:.1f}M bytes)\n"
          f"{summary} (by block: {', '.join(f'{layer}: {share:.3f}' for layer, share in shares.items())})")
    text = vocab.decode(SAMPLE_PROMPT + sample(params, hp, SAMPLE_PROMPT, 200, device))
    print(f"greedy after {SAMPLE_PROMPT!r}:\n{text}")

    description = (f"stratum demo: byte-level glm4moe with a NextN drafter, {n_params / 1e6:.1f}M parameters, trained "
                   f"{steps} steps of {args.batch}x{args.seq_len} bytes on the Python {sys.version.split()[0]} "
                   f"standard library; {summary}")
    tensors = {name: t.detach().float().cpu().numpy() for name, t in params.items()}
    path = demo.export(args.out, tensors, shape, args.seq_len, description)
    print(f"wrote {path.resolve()} ({path.stat().st_size / 1e6:.1f} MB)")
    checked = demo.reference_measures(path, demo.held_out_text(512))
    print("runtime.reference on the file, 512 held-out bytes: " +
          ", ".join(f"{key} {value:.3f}" for key, value in checked.items()))


if __name__ == "__main__":
    main()
