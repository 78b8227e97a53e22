"""Run 23's probe: `kernel_launch_s` (16-array launches into an idle GPU) against the same launches queued
behind a spinning kernel, five times each, in microseconds. (Run before 925ab5e, when the spinning kernel was
runtime.calibrate._spin; it is runtime.ceilings.spin since.)

    NUMBA_ENABLE_CUDASIM=0 PYTHONPATH=. python3 benchmarks/results/launch-probe-2026-12-03-run23.py
"""
import time
import numpy as np
from codegen.lower.cuda import cuda, launch_kernel
from runtime.ceilings import _sixteen_arrays_kernel, kernel_launch_s, spin

arrays = [cuda.device_array(4, np.float32) for _ in range(16)]
stream = cuda.stream()
idle = [kernel_launch_s() * 1e6 for _ in range(5)]
behind = []
for _ in range(5):
    spin[1, 1, stream](100000)
    started = time.perf_counter()
    for q in range(500):
        launch_kernel(_sixteen_arrays_kernel, 1, 32, stream, *arrays, 0, 1, q)
    behind.append((time.perf_counter() - started) / 500 * 1e6)
    stream.synchronize()
print("idle GPU us:", [round(x, 2) for x in idle])
print("behind a spinning kernel us:", [round(x, 2) for x in behind])
