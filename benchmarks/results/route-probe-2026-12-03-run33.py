"""One-off probe (run 33): the decode routing launch and the prefill router at Qwen3-30B-A3B's shape (128
experts, top 8, one row), replayed back to back in a CUDA graph (code and data warm), against an empty node,
the decode step's RMSNorm and its attention combine: what a small kernel costs warm, to set beside what it costs
inside a decode step (benchmarks/decode_nodes.py)."""

import numpy as np

from codegen.graph import moe_groups_length
from codegen.lower import moe, pointwise
from codegen.lower.attention_combine import make_attention_combine
from codegen.graph import ATTENTION_SPLITS
from codegen.lower.cuda import cuda, launch_kernel
from runtime.ceilings import _empty_kernel, graph_seconds

rng = np.random.default_rng(0)
n_expert, k, n = 128, 8, 100
logits = cuda.to_device(rng.standard_normal((1, n_expert)).astype(np.float32))
bias = cuda.to_device(np.zeros(1, np.float32))
ids, weights = cuda.device_array((1, k), np.int32), cuda.device_array((1, k), np.float32)
groups = cuda.device_array(moe_groups_length(n_expert, k), np.int32)
route = moe.make_moe_route(n_expert, k, "softmax", True, 1.0)
router = pointwise.make_router(n_expert, k, "softmax", True, 1.0)
norm = pointwise.make_rmsnorm(2048, 1e-6)
x = cuda.to_device(rng.standard_normal((1, 2048)).astype(np.float32))
w = cuda.to_device(rng.standard_normal(2048).astype(np.float32))
y = cuda.device_array((1, 2048), np.float32)
combine = make_attention_combine(32, 128)
partials = cuda.to_device(rng.standard_normal((1, 32, ATTENTION_SPLITS, 130)).astype(np.float32))
attn = cuda.device_array((1, 32 * 128), np.float32)
out = cuda.device_array(1, np.float32)
cases = {
    "empty kernel": lambda s: launch_kernel(_empty_kernel, 1, 32, s, out),
    "moe_route (decode: top-k, weights, groups)": lambda s: route(s, logits, bias, ids, weights, groups),
    "make_router (top-k, weights), 1 row": lambda s: router(s, logits, bias, ids, weights),
    "rmsnorm 2048, 1 row": lambda s: norm(s, x, w, y),
    "attention combine, 32 heads": lambda s: combine(s, partials, attn),
}
print("| kernel, replayed back to back | us a node |")
print("| --- | ---: |")
for name, enqueue in cases.items():
    print(f"| {name} | {graph_seconds([enqueue] * n) * 1e6:.2f} |")
mixed = [cases["moe_route (decode: top-k, weights, groups)"], cases["attention combine, 32 heads"],
         cases["rmsnorm 2048, 1 row"]] * 40
rest = [cases["attention combine, 32 heads"], cases["rmsnorm 2048, 1 row"]] * 40
print(f"| moe_route between a combine and a norm (per route, the others' time taken out) | "
      f"{(graph_seconds(mixed) * len(mixed) - graph_seconds(rest) * len(rest)) / 40 * 1e6:.2f} |")
