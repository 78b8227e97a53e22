"""The plan's bytes on one GPU as one device allocation, carved into the plan's regions.

Nothing else is allocated on the device (DESIGN.md invariant 1): weights, K/V pages, expert slots, the
activation arena and the runtime's tables are all views into this one array, at the offsets the plan gives.
Inside a region, a `Carver` hands out consecutive 256-byte aligned spans, exactly as the planner counted them
(`planner.layout.tensors_bytes`, `planner.layout.table_sizes`), and refuses to run past the region's end.
"""

import numpy as np

from gguf.constants import GGMLQuantizationType as T

from codegen.lower.cuda import SIMULATOR, cuda, free_device_bytes
from codegen.lower.weights import DeviceWeight, PackedWeight, packed_layout, placeholder_scales
from codegen.memory import ARENA_ALIGNMENT_BYTES
from planner.errors import StratumError
from planner.units import format_bytes


def check_free_memory(need_bytes: int) -> None:
    """Refuse at start, saying by how much, when the GPU has less free memory than the plan takes."""
    if SIMULATOR:
        return
    free_bytes = free_device_bytes()
    if free_bytes < need_bytes:
        raise StratumError(f"the plan needs {format_bytes(need_bytes)} of device memory but the GPU has "
                           f"{format_bytes(free_bytes)} free: {format_bytes(need_bytes - free_bytes)} short "
                           "(another process holds memory, or the plan was made for a larger card)")


class Carver:
    """Consecutive spans of one region, each starting on a multiple of `alignment` bytes (the planner's 256
    for tensors and tables; K/V pages and expert slots pack tighter, as the planner counts them)."""

    def __init__(self, name: str, memory, start: int, size: int, alignment: int = ARENA_ALIGNMENT_BYTES):
        self.name, self.memory, self.start, self.size, self.alignment = name, memory, start, size, alignment
        self.used = 0

    def span(self, nbytes: int):
        """The next `nbytes` (uint8 device view)."""
        if self.used + nbytes > self.size:
            raise StratumError(f"region {self.name} is {format_bytes(self.size)} but needs at least "
                               f"{format_bytes(self.used + nbytes)}: the plan does not match this model")
        begin = self.start + self.used
        self.used = -(-(self.used + nbytes) // self.alignment) * self.alignment
        return self.memory[begin:begin + nbytes]

    def array(self, shape, dtype):
        shape = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.span(nbytes).view(dtype).reshape(shape)

    def empty_weight(self, ggml_type, shape) -> DeviceWeight:
        """Room for a packed weight of numpy `shape`: its data span, then its scales span."""
        (data_shape, dtype), scales_shape = packed_layout(ggml_type, shape)
        data = self.array(data_shape, dtype)
        scales = self.array(scales_shape, np.float16) if scales_shape else placeholder_scales(data)
        return DeviceWeight(T(ggml_type), tuple(shape), data, scales)

    def weight(self, packed: PackedWeight, stream=0) -> DeviceWeight:
        """A packed weight copied into one span: its data, then its scales (a float type's `scales` is a
        placeholder view of its first bytes, never read), the tensor's bytes exactly."""
        span = self.span(packed.nbytes)
        data_bytes = packed.data.nbytes
        data = span[:data_bytes].view(packed.data.dtype).reshape(packed.data.shape)
        data.copy_to_device(packed.data, stream=stream)
        if packed.scales is None:
            scales = placeholder_scales(data)
        else:
            scales = span[data_bytes:].view(np.float16).reshape(packed.scales.shape)
            scales.copy_to_device(packed.scales, stream=stream)
        return DeviceWeight(packed.ggml_type, packed.shape, data, scales)


class DeviceArena:
    """One device allocation of the plan's bytes for GPU `device`; `carver(region)` hands out its spans."""

    def __init__(self, plan, device: int = 0):
        self.regions = {r.name: r for r in plan.regions if r.device == device}
        self.nbytes = plan.device_bytes(device)
        check_free_memory(plan.allocated_bytes(device))     # the pinned host copies' page tables come later
        self.memory = cuda.device_array(self.nbytes, np.uint8)

    def has(self, name: str) -> bool:
        return name in self.regions

    def carver(self, *names: str, alignment: int = ARENA_ALIGNMENT_BYTES) -> Carver:
        """Spans of region `names[0]`, or of the adjacent regions `names` taken as one."""
        missing = [name for name in names if name not in self.regions]
        if missing:
            raise StratumError(f"the plan has no {' or '.join(missing)} region")
        first, last = self.regions[names[0]], self.regions[names[-1]]
        return Carver(" + ".join(names), self.memory, first.offset, last.end - first.offset, alignment)
