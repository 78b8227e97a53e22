"""The second kernel of decode attention: each (row, head)'s split partials merged into its output.

`codegen.lower.attention`'s decode kernel leaves, per (row, query head), ATTENTION_SPLITS partial softmaxes
(running max, sum of exp, weighted V sum) over tile sets of the context; this merges them in split order, so a
row's output depends only on its own position, whatever the window.
"""

import functools
import math

import numpy as np

from codegen.graph import ATTENTION_SPLITS
from codegen.lower.attention import NEG_INF
from codegen.lower.cuda import begin_after_prior_grids, cuda, launch_kernel, overlapping

COMBINE_THREADS = 256     # at most, per block: (dim, run of splits) threads; the simulator runs each thread as
#                           a Python thread (1024 made CI's simulated decode steps 3x slower)
WARP_THREADS = 32
_ZERO = np.float32(0)


@functools.cache
def make_attention_combine(n_head: int, head_dim_v: int):
    """launch(stream, partials, out): each (row, head)'s 64 split partials merged in split order, a block per
    (row, head). Its threads take (dim, run of splits): every V sum the block needs is loaded at once, before
    the splits' weights exp(m_s - max) are known (one round of memory latency, not one per split); each thread
    adds its run in split order, then one thread per dim adds the runs in order. A split that saw no tile
    (weight 0) is skipped, which adds nothing it would not have added (its V sums are zero)."""
    dv, splits = head_dim_v, ATTENTION_SPLITS
    runs = 1
    while 2 * runs * dv <= COMBINE_THREADS and splits % (2 * runs) == 0:
        runs *= 2
    per_run = splits // runs
    threads = max(runs * dv, WARP_THREADS)

    @overlapping
    @cuda.jit
    def kernel(partials, out):
        begin_after_prior_grids()
        tid = cuda.threadIdx.x
        row = cuda.blockIdx.x // n_head
        head = cuda.blockIdx.x % n_head
        maxima = cuda.shared.array(ATTENTION_SPLITS, np.float32)
        sums = cuda.shared.array(ATTENTION_SPLITS, np.float32)
        weights = cuda.shared.array(ATTENTION_SPLITS, np.float32)
        run_sums = cuda.shared.array((runs, dv), np.float32)
        denominator = cuda.shared.array(1, np.float32)
        d = tid % dv
        run = tid // dv
        values = cuda.local.array(per_run, np.float32)
        if run < runs:
            for u in range(per_run):
                values[u] = partials[row, head, run * per_run + u, 2 + d]
        for s in range(tid, splits, threads):
            maxima[s] = partials[row, head, s, 0]
            sums[s] = partials[row, head, s, 1]
        cuda.syncthreads()
        for s in range(tid, splits, threads):
            top = NEG_INF
            for t in range(splits):
                top = max(top, maxima[t])
            weights[s] = _ZERO if maxima[s] == NEG_INF else math.exp(maxima[s] - top)
        cuda.syncthreads()
        if tid == 0:
            den = _ZERO
            for t in range(splits):
                if weights[t] != _ZERO:
                    den += weights[t] * sums[t]
            denominator[0] = den
        if run < runs:
            part = _ZERO
            for u in range(per_run):
                w = weights[run * per_run + u]
                if w != _ZERO:
                    part += w * values[u]
            run_sums[run, d] = part
        cuda.syncthreads()
        if tid < dv:
            num = _ZERO
            for r in range(runs):
                num += run_sums[r, tid]
            out[row, head * dv + tid] = num / denominator[0]

    def launch(stream, partials, out):
        if partials.shape[0]:
            launch_kernel(kernel, partials.shape[0] * n_head, threads, stream, partials, out)
    return launch
