"""Run 26's probe: the host time of a prefill-ring copy as detect measures it (queued behind a spinning kernel)
against the same copy into an idle stream, at 4 KiB and 64 KiB rows, one row or 8 rows a copy."""
import time

import numpy as np

from codegen.lower.cuda import copy_into_rows, cuda
from runtime import ceilings


def idle_copy_s(rows: int, row_bytes: int, calls: int = 400) -> float:
    source = cuda.pinned_array((64, row_bytes), np.uint8)
    slots = cuda.device_array((64, 2 * row_bytes), np.uint8)
    stream = cuda.stream()
    best = np.inf
    for _ in range(5):
        stream.synchronize()
        started = time.perf_counter()
        for i in range(calls):
            copy_into_rows(slots, (i * rows) % (64 - rows), row_bytes, source, (i * rows) % (64 - rows), rows, stream)
        best = min(best, (time.perf_counter() - started) / calls)
    stream.synchronize()
    return best


print(f"detect's copy_call_s (behind a spin, 1 row of 4 KiB): {ceilings.copy_call_s() * 1e6:.2f} us")
print(f"detect's kernel_launch_s: {ceilings.kernel_launch_s() * 1e6:.2f} us; event_call_s {ceilings.event_call_s() * 1e6:.2f} us")
for rows, row_bytes in ((1, 4096), (1, 65536), (8, 65536), (1, 1 << 20)):
    print(f"idle stream, {rows} rows of {row_bytes} B a copy: {idle_copy_s(rows, row_bytes) * 1e6:.2f} us a copy")
