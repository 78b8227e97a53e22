"""One-off probe (run 35): where a one-row router launch's ~7.5 us goes (run 34: the block router, the warp
router and the old rank count all cost 7-8 us warm, an RMSNorm row 2.1). Kernels of Qwen3-30B-A3B's router
shape (128 experts, top 8, one row), each replayed 100 times back to back in a CUDA graph: the block router at
several block sizes, then kernels that do only a part of its work."""

import math

import numpy as np

from codegen.lower import pointwise
from codegen.lower.cuda import cuda, launch_kernel, warp_sum
from runtime.ceilings import _empty_kernel, graph_seconds

E, K, N = 128, 8, 100
rng = np.random.default_rng(0)
logits = cuda.to_device(rng.standard_normal((1, E)).astype(np.float32))
bias = cuda.to_device(np.zeros(1, np.float32))
bias_e = cuda.to_device((rng.standard_normal(E) * 0.1).astype(np.float32))
ids, weights = cuda.device_array((1, K), np.int32), cuda.device_array((1, K), np.float32)
out = cuda.device_array(1, np.float32)


def wrap(route):
    @cuda.jit
    def kernel(logits, bias, ids, weights):
        route(logits, bias, cuda.blockIdx.x, ids, weights)
    return kernel


def barriers_kernel(barriers: int):
    """Load a row into shared memory, wait on `barriers` barriers, store k values."""
    @cuda.jit
    def kernel(logits, bias, ids, weights):
        t = cuda.threadIdx.x
        raw = cuda.shared.array(E, np.float32)
        raw[t] = logits[0, t]
        for _ in range(barriers):
            cuda.syncthreads()
        if t < K:
            ids[0, t] = t
            weights[0, t] = raw[t]
    return kernel


@cuda.jit
def exp_and_warp_sum(logits, bias, ids, weights):
    t = cuda.threadIdx.x
    exps = cuda.local.array(1, np.float32)
    sums = cuda.shared.array(4, np.float32)
    exps[0] = np.float32(math.exp(logits[0, t]))
    warp_sum(exps, 1)
    if t % 32 == 0:
        sums[t // 32] = exps[0]
    cuda.syncthreads()
    if t < K:
        ids[0, t] = t
        weights[0, t] = sums[0] + sums[1] + sums[2] + sums[3]


@cuda.jit
def rank_loop(logits, bias, ids, weights):
    t = cuda.threadIdx.x
    scores = cuda.shared.array(E, np.float32)
    scores[t] = logits[0, t]
    cuda.syncthreads()
    mine = scores[t]
    beats = 0
    for j in range(E):
        other = scores[j]
        beats += (other > mine) | ((other == mine) & (j < t))
    if beats < K:
        ids[0, beats] = t
        weights[0, beats] = mine


cases = {"empty kernel": lambda s: launch_kernel(_empty_kernel, 1, 32, s, out)}
for threads in (32, 128, 512, 1024):
    kernel = wrap(pointwise.block_router(E, K, "softmax", True, 1.0, threads))
    cases[f"block router, softmax, {threads} threads"] = (
        lambda s, kernel=kernel, threads=threads: launch_kernel(kernel, 1, threads, s, logits, bias, ids, weights))
kernel = wrap(pointwise.block_router(E, K, "sigmoid", True, 1.0, 128))
cases["block router, sigmoid, 128 threads"] = lambda s: launch_kernel(kernel, 1, 128, s, logits, bias_e, ids, weights)
for name, part in (("load, one barrier, store", barriers_kernel(1)),
                   ("load, four barriers, store", barriers_kernel(4)),
                   ("exp and a warp_sum", exp_and_warp_sum), ("the rank loop over 128 experts", rank_loop)):
    cases[f"{name}, 128 threads"] = lambda s, part=part: launch_kernel(part, 1, 128, s, logits, bias, ids, weights)
print("| kernel (one row of 128 experts), replayed back to back | us a node |")
print("| --- | ---: |")
for name, enqueue in cases.items():
    print(f"| {name} | {graph_seconds([enqueue] * N) * 1e6:.2f} |", flush=True)
