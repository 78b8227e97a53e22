"""The ceilings every kernel figure is a fraction of, measured in the same run, and a GPU timer.

    python benchmarks/ceilings.py      # prints the device's read bandwidth and FP32 peak

  read_bandwidth_bytes_per_s(): a grid-stride kernel summing 4 GiB of device memory with 16-byte-per-thread
      unrolled 32-bit loads (DEVICE.md measured 3.68 TB/s on the H200 this way);
  fp32_peak_flops(): a kernel of independent FMA chains in registers (2 FLOPs per FMA).
"""

import numpy as np

from codegen.lower.cuda import cuda

READ_BYTES = 4 << 30
FMA_CHAINS = 8      # independent FMA chains per thread
FMA_STEPS = 4096


def time_s(launch, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds of `launch()` (which enqueues work on the default stream), timed with CUDA events."""
    for _ in range(warmup):
        launch()
    times = []
    for _ in range(repeats):
        start, stop = cuda.event(), cuda.event()
        start.record()
        launch()
        stop.record()
        stop.synchronize()
        times.append(cuda.event_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


@cuda.jit
def _read_kernel(words, out):
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    total = np.int32(0)
    n_quads = words.size // 4
    for quad in range(start, n_quads, stride):
        i = quad * 4
        total ^= words[i] ^ words[i + 1] ^ words[i + 2] ^ words[i + 3]
    if total == 1234567:      # never true on the data; keeps the loads alive
        out[0] = total


@cuda.jit
def _fma_kernel(out, seed):
    # eight independent chains in scalars (registers), so each SM issues an FMA every cycle on every lane
    a0, a1, a2, a3 = seed, seed + np.float32(1), seed + np.float32(2), seed + np.float32(3)
    a4, a5, a6, a7 = seed + np.float32(4), seed + np.float32(5), seed + np.float32(6), seed + np.float32(7)
    m, c = np.float32(0.9999), np.float32(0.0001)
    for _ in range(FMA_STEPS):
        a0 = a0 * m + c
        a1 = a1 * m + c
        a2 = a2 * m + c
        a3 = a3 * m + c
        a4 = a4 * m + c
        a5 = a5 * m + c
        a6 = a6 * m + c
        a7 = a7 * m + c
    total = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7
    if total == np.float32(-1):
        out[0] = total


def read_bandwidth_bytes_per_s() -> float:
    words = cuda.device_array(READ_BYTES // 4, np.int32)
    words[:] = 0
    out = cuda.device_array(1, np.int32)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    seconds = time_s(lambda: _read_kernel[sms * 8, 512](words, out))
    return READ_BYTES / seconds


def fp32_peak_flops() -> float:
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    blocks, threads = sms * 8, 1024
    out = cuda.device_array(1, np.float32)
    seconds = time_s(lambda: _fma_kernel[blocks, threads](out, np.float32(1.0)))
    return blocks * threads * FMA_STEPS * FMA_CHAINS * 2 / seconds


def main():
    print(f"device read bandwidth: {read_bandwidth_bytes_per_s() / 1e12:.2f} TB/s")
    print(f"FP32 peak (FMA):       {fp32_peak_flops() / 1e12:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
