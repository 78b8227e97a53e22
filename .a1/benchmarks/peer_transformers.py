"""The peer for benchmarks/e2e.py: Hugging Face transformers' Qwen3-MoE at the same shape (the card's, with
`--layers` blocks), random bf16 weights on the same GPU, eager PyTorch with its K/V cache: prefill tok/s for
one prompt, decode tok/s for greedy new tokens. torch and transformers are on the device image; they are not
stratum's dependencies.

    python3 benchmarks/peer_transformers.py --layers 12
"""

import argparse
import time

import torch
import yaml
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from plans import MODELS_DIR

CARD = "qwen3-30b-a3b-q8_0"


def config_for(layers: int) -> Qwen3MoeConfig:
    meta = yaml.safe_load((MODELS_DIR / f"{CARD}.yaml").read_text())["metadata"]
    return Qwen3MoeConfig(vocab_size=meta["vocab_size"], hidden_size=meta["embedding_length"],
                          intermediate_size=meta["feed_forward_length"],
                          moe_intermediate_size=meta["expert_feed_forward_length"], num_hidden_layers=layers,
                          num_attention_heads=meta["attention.head_count"],
                          num_key_value_heads=meta["attention.head_count_kv"], head_dim=meta["attention.key_length"],
                          num_experts=meta["expert_count"], num_experts_per_tok=meta["expert_used_count"],
                          rms_norm_eps=meta["attention.layer_norm_rms_epsilon"], rope_theta=meta["rope.freq_base"],
                          max_position_embeddings=8192, norm_topk_prob=True, mlp_only_layers=[],
                          decoder_sparse_step=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(config_for(args.layers)).to(torch.bfloat16).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens), device="cuda")
    with torch.inference_mode():
        model(ids[:, :64])                          # warm-up
        torch.cuda.synchronize()
        started = time.perf_counter()
        model(ids)
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
        torch.cuda.synchronize()
        generate_s = time.perf_counter() - started
    decode_s = (generate_s - prefill_s) / (out.shape[1] - ids.shape[1] - 1)
    print(f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}: Qwen3-MoE {args.layers} blocks bf16")
    print(f"prefill {args.prompt_tokens / prefill_s:.1f} tok/s ({args.prompt_tokens} tokens), "
          f"decode {1 / decode_s:.2f} tok/s ({args.new_tokens} new)")


if __name__ == "__main__":
    main()
