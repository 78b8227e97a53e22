"""Run 25's probe: how much device memory does mapped (and plain) pinned host memory take? cuMemGetInfo's free
bytes before and after taking it, for a few sizes, one allocation or many of 96 MiB (the engine takes one a
(block, matrix) array)."""
import gc

import numpy as np

from codegen.lower.cuda import cuda

ctx = cuda.current_context()


def free_bytes():
    cuda.synchronize()
    return ctx.get_memory_info()[0]


cuda.device_array(1)        # the context first
for kind in ("mapped", "pinned"):
    take = cuda.mapped_array if kind == "mapped" else cuda.pinned_array
    for total_mib, piece_mib in ((256, 256), (1024, 1024), (4096, 4096), (4096, 96), (8192, 8192), (16384, 16384)):
        before = free_bytes()
        arrays = [take(piece_mib << 20, np.uint8) for _ in range(max(1, total_mib // piece_mib))]
        taken = sum(a.nbytes for a in arrays)
        after = free_bytes()
        del arrays
        gc.collect()
        ctx.deallocations.clear()
        print(f"{kind:6s} {taken / 2**20:8.0f} MiB in {max(1, total_mib // piece_mib):3d} pieces: device "
              f"{(before - after) / 2**20:7.2f} MiB ({(before - after) / taken * 4096:.2f} B per 4 KiB), after "
              f"release {(before - free_bytes()) / 2**20:6.2f} MiB", flush=True)
