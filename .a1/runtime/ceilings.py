"""The ceilings every kernel figure is a fraction of, measured in the same run, and a GPU timer.

    python -m runtime.ceilings      # prints the device's read bandwidth and FP32 peak

  read_bandwidth_bytes_per_s(): a grid-stride kernel summing 4 GiB of device memory with 16-byte-per-thread
      unrolled 32-bit loads (DEVICE.md measured 3.68 TB/s on the H200 this way);
  pinned_copy_bytes_per_s(), zero_copy_read_bytes_per_s(): the host links, copied (either way) and read in
      place; copy_latency_s(): one small pinned copy's fixed cost; read_latency_s(),
      zero_copy_read_latency_s(): one dependent load from device memory and from mapped host memory (a chase);
  read_seconds(nbytes): the same kernel reading nbytes once, a node of a replayed graph (a short read's ramp
      and drain included: the ceiling of a kernel that reads that many bytes);
  graph_seconds(): kernels timed as a replayed CUDA graph; graph_node_overhead_s(): one empty node's cost there;
  kernel_launch_s(): host time to issue one kernel from Python (`launch_kernel`); copy_call_s(), event_call_s():
      host time of the prefill ring's other calls, an expert matrix's copy and an event's record or wait;
  host_page_table_entry_bytes(): device memory the driver takes per 4 KiB page of pinned host memory;
  fp32_peak_flops(): kernels of independent FMA chains in registers (2 FLOPs per FMA), the best shape;
  fp32_datasheet_flops(): SMs x 128 lanes x 2 x clock, what the datasheet's 67 TFLOP/s means.
"""

import subprocess
import time

import numpy as np

from codegen.lower.cuda import CapturedGraph, copy_into_rows, copy_rows, cuda, launch_kernel, mapped_filled

READ_BYTES = 4 << 30
FMA_STEPS = 2048
FMA_SHAPES = ((8, 1024), (16, 512), (32, 256))   # (independent chains per thread, threads per block)


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


def _fma_kernel_of(chains: int):
    """A kernel of `chains` independent FMA chains per thread, in registers (2 FLOPs per FMA)."""
    @cuda.jit
    def kernel(out, seed):
        acc = cuda.local.array(chains, np.float32)
        for c in range(chains):
            acc[c] = seed + np.float32(c)
        m, add = np.float32(0.9999), np.float32(0.0001)
        for _ in range(FMA_STEPS):
            for c in range(chains):
                acc[c] = acc[c] * m + add
        total = np.float32(0)
        for c in range(chains):
            total += acc[c]
        if total == np.float32(-1):
            out[0] = total
    return kernel


def read_bandwidth_bytes_per_s() -> float:
    words = cuda.device_array(READ_BYTES // 4, np.int32)
    words[:] = 0
    out = cuda.device_array(1, np.int32)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    seconds = time_s(lambda: _read_kernel[sms * 8, 512](words, out))
    return READ_BYTES / seconds


L2_DEFEAT_BYTES = 256 << 20     # bytes of weight (or K/V) copies a timed graph cycles through, at least


def l2_defeating_copies(nbytes: int) -> int:
    """Copies of an `nbytes` array that timed launches cycle through so that L2 (50-60 MiB) holds none of them."""
    return max(1, -(-L2_DEFEAT_BYTES // nbytes))


def graph_seconds(enqueues, repeats: int = 10) -> float:
    """Seconds per item of `enqueues` (each enqueue(stream) launches kernels), all captured into one CUDA graph
    (as the runtime replays a decode step: a figure is the kernels plus ~1 us a node, not Python's launch cost)
    and the graph replayed `repeats` times."""
    stream = cuda.stream()

    def enqueue_all(on):
        for enqueue in enqueues:
            enqueue(on)
    enqueue_all(stream)         # compile and load every kernel before capturing
    stream.synchronize()
    graph = CapturedGraph(enqueue_all, stream)
    try:
        return time_s(lambda: graph.replay(cuda.default_stream()), repeats, warmup=2) / len(enqueues)
    finally:
        graph.close()


def read_seconds(nbytes: int) -> float:
    """Seconds of `_read_kernel` reading `nbytes` of device memory, a node of a replayed graph that cycles
    through enough copies that L2 holds none: what a kernel reading that many bytes once can reach, the launch's
    ramp and drain included, which a 4 GiB read hides."""
    copies = l2_defeating_copies(nbytes)
    buffers = [cuda.device_array(-(-nbytes // 16) * 4, np.int32) for _ in range(copies)]
    for words in buffers:
        words[:] = 1
    out = cuda.device_array(1, np.int32)
    grid = cuda.get_current_device().MULTIPROCESSOR_COUNT * 8
    return graph_seconds([lambda stream, words=words: launch_kernel(_read_kernel, grid, 512, stream, words, out)
                          for words in buffers * -(-8 // copies)])


def pinned_copy_bytes_per_s(nbytes: int = 1 << 30, to_device: bool = True) -> float:
    """Copy bandwidth between page-locked host memory and the device (host to device streams experts through
    the ring; device to host writes K/V pages to their host copy)."""
    host = cuda.pinned_array(nbytes, np.uint8)
    host[:] = 1
    device = cuda.device_array(nbytes, np.uint8)
    copy = (lambda: device.copy_to_device(host)) if to_device else (lambda: device.copy_to_host(host))
    return nbytes / time_s(copy, repeats=5, warmup=1)


def copy_latency_s(copies: int = 200, nbytes: int = 4096) -> float:
    """Seconds per 4 KiB pinned host-to-device copy issued back to back (`copy_rows`, one driver call each):
    a copy's fixed cost before its bytes flow, submission included."""
    host = cuda.pinned_array((copies, nbytes), np.uint8)
    host[:] = 1
    device = cuda.device_array((copies, nbytes), np.uint8)
    stream = cuda.stream()
    copy_rows(device, 0, host, 0, 1, stream)
    stream.synchronize()
    started = time.perf_counter()
    for row in range(copies):
        copy_rows(device, row, host, row, 1, stream)
    stream.synchronize()
    return (time.perf_counter() - started) / copies


@cuda.jit
def _empty_kernel(out):
    if cuda.grid(1) == -1:      # never: only the launch is measured
        out[0] = 0


def graph_node_overhead_s(nodes: int = 400) -> float:
    """Seconds per node of a replayed CUDA graph of empty kernels (what each decode kernel costs beyond its work)."""
    out = cuda.device_array(1, np.float32)
    return graph_seconds([lambda stream: launch_kernel(_empty_kernel, 1, 32, stream, out)] * nodes)


def zero_copy_read_bytes_per_s(nbytes: int = 1 << 30) -> float:
    """A kernel reading mapped pinned host memory in place (what a decode-step expert-cache miss costs)."""
    words = mapped_filled(nbytes // 4, np.int32)
    out = cuda.device_array(1, np.int32)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    return nbytes / time_s(lambda: _read_kernel[sms * 8, 512](words, out), repeats=5, warmup=1)


LINE_WORDS = 32             # a pointer chase's hop: one 128-byte line, so no two hops share one
CHASE_BYTES = 256 << 20     # the chased buffer: five times the H200's L2, and hops never revisit a line


@cuda.jit
def _chase_kernel(next_word, hops, at):
    """One thread following `hops` dependent loads from at[0], leaving where it stopped there (the next
    launch goes on from it: no line is read twice)."""
    i = at[0]
    for _ in range(hops):
        i = next_word[i]
    at[0] = i


def _chase_latency_s(next_word, hops: int = 4000) -> float:
    """Seconds of one dependent load: the long chase's time less a short one's, over the hops between."""
    at = cuda.to_device(np.zeros(1, np.int32))
    short = hops // 8
    times = {n: time_s(lambda n=n: _chase_kernel[1, 1](next_word, n, at), repeats=5, warmup=1) for n in (short, hops)}
    return (times[hops] - times[short]) / (hops - short)


def _chase_cycle(n_words: int) -> np.ndarray:
    """int32 words whose line starts form one random cycle through every line (the rest are 0)."""
    lines = np.random.default_rng(0).permutation(n_words // LINE_WORDS).astype(np.int64) * LINE_WORDS
    words = np.zeros(n_words, np.int32)
    words[lines] = np.roll(lines, -1)
    return words


def read_latency_s() -> float:
    """One dependent load from device memory that no cache holds (a kernel's first round of loads waits this)."""
    return _chase_latency_s(cuda.to_device(_chase_cycle(CHASE_BYTES // 4)))


def zero_copy_read_latency_s() -> float:
    """One dependent load from mapped pinned host memory (a decode kernel's round of loads of an expert the
    cache misses waits this, over the link)."""
    words = mapped_filled(CHASE_BYTES // 4, np.int32)
    words[:] = _chase_cycle(CHASE_BYTES // 4)
    return _chase_latency_s(words)


@cuda.jit
def _sixteen_arrays_kernel(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, lo, hi, q):
    if cuda.grid(1) == 0 and lo > hi:       # never true here: the kernel only has to be launched
        a[0] = (b[0] + c[0] + d[0] + e[0] + f[0] + g[0] + h[0] + i[0] + j[0] + k[0] + l[0] + m[0] + n[0] + o[0]
                + p[0] + q)


def kernel_launch_s(launches: int = 2000) -> float:
    """Host seconds to issue one kernel from Python through `launch_kernel`, for a kernel of a prefill MoE
    launch's size (16 device arrays, 3 integers); a profile's `kernel_launch`."""
    arrays = [cuda.device_array(4, np.float32) for _ in range(16)]
    stream = cuda.stream()
    for _ in range(3):
        launch_kernel(_sixteen_arrays_kernel, 1, 32, stream, *arrays, 0, 1, 2)
    stream.synchronize()
    started = time.perf_counter()
    for q in range(launches):
        launch_kernel(_sixteen_arrays_kernel, 1, 32, stream, *arrays, 0, 1, q)
    seconds = (time.perf_counter() - started) / launches
    stream.synchronize()
    return seconds


@cuda.jit
def spin(microseconds):
    """Holds the GPU for about `microseconds`: work queued behind it waits, and the host's calls never do."""
    for _ in range(microseconds):
        cuda.nanosleep(1000)


def host_call_s(call, streams, calls: int = 400, repeats: int = 5) -> float:
    """Host seconds of one `call(i)`, queued behind a spinning kernel on each of `streams` (the GPU never holds
    the host up): the best of `repeats` runs of `calls`."""
    best = np.inf
    for _ in range(repeats):
        for stream in streams:
            spin[1, 1, stream](60000)
        started = time.perf_counter()
        for i in range(calls):
            call(i)
        best = min(best, (time.perf_counter() - started) / calls)
        for stream in streams:
            stream.synchronize()
    return float(best)


def copy_call_s(rows: int = 64, row_bytes: int = 4096) -> float:
    """Host time of one prefill ring copy (`copy_into_rows`: an expert matrix's row from pinned memory into a
    part of a slot's row, as `runtime.experts` streams them); a profile's `copy_call`."""
    source = cuda.pinned_array((rows, row_bytes), np.uint8)
    slots = cuda.device_array((rows, 2 * row_bytes), np.uint8)
    stream = cuda.stream()
    return host_call_s(lambda i: copy_into_rows(slots, i % rows, row_bytes, source, i % rows, 1, stream), [stream])


def event_call_s() -> float:
    """Host time of an event call of the prefill ring (a record on one stream, or another stream's wait on it:
    the mean of the two); a profile's `event_call`."""
    copies, compute, event = cuda.stream(), cuda.stream(), cuda.event()
    return (host_call_s(lambda i: event.record(copies), [copies, compute])
            + host_call_s(lambda i: event.wait(compute), [copies, compute])) / 2


def host_page_table_entry_bytes(nbytes: int = 4 << 30) -> float:
    """Device bytes the driver takes to map each 4 KiB page of pinned host memory (its page tables): free
    device memory before and after pinning `nbytes` (4 GiB: the H200's tables grow in 2 MiB pieces, and 8 MiB
    of them read to within a piece); a profile's `host_page_table_entry`."""
    context = cuda.current_context()
    cuda.synchronize()
    before = context.get_memory_info()[0]
    pinned = cuda.pinned_array(nbytes, np.uint8)
    cuda.synchronize()
    taken = before - context.get_memory_info()[0]
    del pinned
    return taken / (nbytes // 4096)


def fp32_peak_flops() -> float:
    """The best of a few shapes (chains per thread x threads per block): the highest FMA rate this GPU gives
    numba-compiled code."""
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    out = cuda.device_array(1, np.float32)
    best = 0.0
    for chains, threads in FMA_SHAPES:
        kernel, blocks = _fma_kernel_of(chains), sms * 2048 // threads * 4
        seconds = time_s(lambda: kernel[blocks, threads](out, np.float32(1.0)))
        best = max(best, blocks * threads * FMA_STEPS * chains * 2 / seconds)
    return best


def fp32_datasheet_flops() -> float:
    """SMs x 128 FP32 lanes x 2 FLOPs x the maximum SM clock (nvidia-smi)."""
    clock_hz = float(subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                                    capture_output=True, text=True, check=True).stdout.split()[0]) * 1e6
    return cuda.get_current_device().MULTIPROCESSOR_COUNT * 128 * 2 * clock_hz


def main():
    print(f"device read bandwidth: {read_bandwidth_bytes_per_s() / 1e12:.2f} TB/s")
    print(f"pinned host -> device: {pinned_copy_bytes_per_s() / 1e9:.1f} GB/s, device -> host "
          f"{pinned_copy_bytes_per_s(to_device=False) / 1e9:.1f} GB/s; zero-copy read "
          f"{zero_copy_read_bytes_per_s() / 1e9:.1f} GB/s; a 4 KiB copy {copy_latency_s() * 1e6:.1f} us")
    print(f"a dependent load: {read_latency_s() * 1e6:.2f} us from device memory, "
          f"{zero_copy_read_latency_s() * 1e6:.2f} us from mapped host memory")
    print(f"graph node: {graph_node_overhead_s() * 1e6:.2f} us; host page tables "
          f"{host_page_table_entry_bytes():.2f} B per 4 KiB page pinned")
    print(f"kernel launch from Python: {kernel_launch_s() * 1e6:.1f} us; a ring copy {copy_call_s() * 1e6:.1f} us, "
          f"an event call {event_call_s() * 1e6:.1f} us")
    print(f"FP32 peak (FMA):       {fp32_peak_flops() / 1e12:.1f} TFLOP/s measured, "
          f"{fp32_datasheet_flops() / 1e12:.1f} TFLOP/s datasheet (SMs x 128 x 2 x max SM clock)")


if __name__ == "__main__":
    main()
