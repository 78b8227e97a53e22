"""A profile's `decode_weight_rates` (`planner.profile.GPU`): how fast the decode matmul reads each weight type,
as a share of the bytes per second it reads Q8_0 at (the type the decode families are calibrated on).

The decode matmul is memory-bound for Q8_0, but a 4-bit type costs about as many instructions a value in half
the bytes, and a lane holds fewer rows of Q6_K: on the H100 Q4_K read at 26-39% of the bandwidth where Q8_0
read at 65-95% (BENCHMARKS.md, run 45). Priced at Q8_0's rate, a Q4_K_M model's decode was predicted 66% too
fast. Each type is timed at RATE_SHAPE as a replayed graph (the way a decode step runs), one token, its weights
cycled through enough copies that L2 holds none, and its rate is its bytes per second over Q8_0's.
"""

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from codegen.lower import matmul, weights
from codegen.lower.cuda import cuda
from runtime.ceilings import graph_seconds, l2_defeating_copies
from runtime.synthetic import random_packed

# (n_out, n_in): the calibration model's output head (Qwen3-30B-A3B: 2048 wide, the width of its dense
# matrices), large enough that a launch's latency is a few percent of its time
RATE_SHAPE = (151936, 2048)
RATE_TYPES = (T.F16, T.BF16, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K)     # against T.Q8_0
LAUNCHES = 8                    # launches per timed graph, at least
REPLAYS = 10                    # times the graph is replayed


def read_bytes_per_s(ggml_type, rng, shape=RATE_SHAPE, launches: int = LAUNCHES, replays: int = REPLAYS,
                     copies: int | None = None) -> float:
    """Weight bytes per second the production decode matmul reads one token's product of `ggml_type` at: a
    graph of `launches` launches (at least one a weight copy) replayed `replays` times, the launches cycling
    through `copies` copies of the weights (default: `l2_defeating_copies`)."""
    n_out, n_in = shape
    packed = random_packed(shape, ggml_type, rng)
    copies = copies or l2_defeating_copies(packed.nbytes)
    device = [weights.upload(packed) for _ in range(copies)]
    launch = matmul.make_matmul("decode", ggml_type, n_in, n_out, False)
    no_bias = cuda.to_device(np.zeros(1, np.float32))
    x = cuda.to_device(rng.standard_normal((1, n_in), dtype=np.float32))
    out = cuda.device_array((1, n_out), np.float32)
    enqueues = [lambda stream, i=i: launch(stream, x, device[i % copies], no_bias, out)
                for i in range(max(copies, launches))]
    return packed.nbytes / graph_seconds(enqueues, replays)


def decode_weight_rates(rng, types=RATE_TYPES, shape=RATE_SHAPE, note=print, **timing) -> dict:
    """Type name -> its decode rate over Q8_0's (3 significant digits), each measured at `shape`; timing:
    `read_bytes_per_s`'s launches, replays and copies."""
    q8_0 = read_bytes_per_s(T.Q8_0, rng, shape, **timing)
    note(f"  decode matmul {shape[0]} x {shape[1]}: Q8_0 read at {q8_0 / 1e9:.0f} GB/s")
    rates = {}
    for ggml_type in types:
        rate = read_bytes_per_s(ggml_type, rng, shape, **timing) / q8_0
        rates[ggml_type.name] = float(f"{rate:.3g}")
        note(f"  {ggml_type.name}: {rates[ggml_type.name]} of Q8_0's rate")
    return rates
