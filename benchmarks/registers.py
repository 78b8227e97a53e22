"""Registers per thread of the decode matmul kernels, compiled here without a GPU: numba emits the PTX, the
CUDA toolkit's `ptxas` assigns registers (what occupancy depends on: 256 threads a block at more than 128
registers leave one block per SM). A change to a decode kernel's source shows its register cost in seconds,
before any device time is spent.

    CUDA_HOME=/usr/local/cuda-13.0 python3 benchmarks/registers.py [--types Q4_K,Q8_0] [--windows 1,4]
        [--shapes 12288x4096] [--listing]

Needs libnvvm (under CUDA_HOME) and ptxas; not libnvrtc or a driver. Where `nvdisasm` is found too (PATH,
CUDA_HOME/bin or $NVDISASM; pip's nvidia-cuda-nvdisasm wheel has one), it also counts the SASS instructions of
the kernel's main loop (its widest backward branch), divides them by the 16-byte weight loads a lane issues an
iteration, and gives the weight bytes an SM would read a clock if it issued nothing but that loop at its 4 warp
instructions a clock: a ceiling to set beside the read bandwidth an SM a clock (an H100's 3.04 TB/s over 132 SMs
is 11.6 bytes a clock at 1.98 GHz, 13.1 at 1.755). `--listing` prints each main loop's global loads, f16 scale
conversions and branches at their places in the loop: where a prefetch goes out, and where a lane first waits
for it.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

from gguf.constants import GGMLQuantizationType as T

SHAPES = [(4096, 4096), (4096, 12288), (12288, 4096), (4096, 151936)]      # (n_in, n_out)
ARCH = (9, 0)


def _without_nvrtc():
    """numba asks libnvrtc which architectures it supports before compiling PTX; answer without it (and
    whether kernels may overlap, which would ask the driver for the GPU)."""
    from numba.cuda import cuda_paths
    from numba.cuda.cudadrv import nvrtc
    from codegen.lower import cuda
    cuda.kernels_overlap = lambda: ARCH >= (9, 0)
    nvrtc.get_supported_ccs = lambda: ((8, 0), ARCH)
    cuda_paths._get_nvrtc_path = lambda: cuda_paths._env_path_tuple("none", None)


def decode_ptx(ggml_type, n_in: int, n_out: int, window: int):
    """(PTX, DecodeShape) of the dense decode kernel (no bias, no SwiGLU) for this shape and window."""
    from numba import types
    from numba.cuda import compile_ptx
    from codegen.lower import matmul_decode
    from codegen.lower.word_formats import FORMATS
    fmt = FORMATS[ggml_type]
    shape = matmul_decode.decode_shape(fmt, n_in, n_out, window)
    launch = matmul_decode.decode_kernel(ggml_type, n_in, False, False, shape, False)
    kernel = next(cell.cell_contents for cell in launch.__closure__ if hasattr(cell.cell_contents, "py_func"))
    scale = types.uint16 if fmt.header_bits else types.float16
    signature = (types.float32[:, ::1], types.int32[::1], scale[::1], types.int32[::1], scale[::1],
                 types.float32[::1], types.float32[:, ::1])
    ptx, _ = compile_ptx(kernel.py_func, signature, cc=ARCH)
    return ptx, shape


def registers(ptxas: str, ptx: str, nvdisasm: str | None = None) -> tuple:
    """(registers, spill store bytes, nvdisasm's listing of the cubin or None) for the PTX: ptxas's report, and
    the listing where nvdisasm is given."""
    with tempfile.TemporaryDirectory() as folder:
        source, cubin = os.path.join(folder, "kernel.ptx"), os.path.join(folder, "kernel.cubin")
        with open(source, "w") as file:
            file.write(ptx)
        report = subprocess.run([ptxas, f"-arch=sm_{ARCH[0]}{ARCH[1]}", "-v", source, "-o", cubin],
                                capture_output=True, text=True, check=True).stderr
        listing = (subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
                   if nvdisasm else None)
    used = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return int(used.group(1)), int(spills.group(1)) if spills else 0, listing


def _loop(listing: str) -> list[str]:
    """The instructions (and labels) from a label to the farthest branch back to it in an nvdisasm listing, the
    kernel's main loop ([] if it has none)."""
    lines, labels, widest = [], {}, (0, 0)
    for line in listing.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(lines)
            lines.append(label.group(1) + ":")
        elif re.match(r"\s*/\*[0-9a-f]{4,}\*/", line):
            lines.append(re.sub(r"/\*[0-9a-f]+\*/\s*", "", line.strip()))
            target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
            if target and target.group(1) in labels and len(lines) - labels[target.group(1)] > widest[1] - widest[0]:
                widest = (labels[target.group(1)], len(lines))
    return lines[widest[0]:widest[1]]


def loop_instructions(listing: str) -> int:
    """Instructions in the kernel's main loop (0: no loop)."""
    return sum(not line.endswith(":") for line in _loop(listing))


def loop_listing(listing: str) -> list[str]:
    """The main loop's global loads, f16 scale conversions and branches, each at its instruction's place in the
    loop: where a prefetch's loads go out and where their first use makes a lane wait for them."""
    shown, at = [], 0
    for line in _loop(listing):
        if line.endswith(":"):
            shown.append(line)
            continue
        if any(key in line for key in ("LDG", "HADD2.F32", "BRA")):
            shown.append(f"{at:5} {line}")
        at += 1
    return shown


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="F32,Q8_0,Q4_0,Q4_K,Q6_K")
    parser.add_argument("--windows", default="1,4")
    parser.add_argument("--shapes", help="n_in x n_out pairs, e.g. 12288x4096 (default: the four of SHAPES)")
    parser.add_argument("--listing", action="store_true",
                        help="print each kernel's main loop: its global loads, f16 conversions and branches")
    args = parser.parse_args(argv)
    shapes = SHAPES if not args.shapes else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    ptxas = shutil.which("ptxas") or os.path.join(home, "bin", "ptxas")
    if not os.path.exists(ptxas):
        print(f"no ptxas on PATH or under CUDA_HOME={home}", file=sys.stderr)
        return 2
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm") or os.path.join(home, "bin", "nvdisasm")
    nvdisasm = nvdisasm if os.path.exists(nvdisasm) else None
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
    _without_nvrtc()
    from codegen.lower.word_formats import FORMATS
    print(f"{'type':6} {'n_in':>6} {'n_out':>6} {'window':>6} {'tg':>4} {'rows':>4} {'regs':>5} {'spill B':>7}"
          f" {'blocks/SM':>9}" + (f" {'loop':>5} {'per 16 B':>8} {'B/clk/SM':>10}" if nvdisasm else ""))
    for name in args.types.split(","):
        for window in map(int, args.windows.split(",")):
            for n_in, n_out in shapes:
                ptx, shape = decode_ptx(T[name], n_in, n_out, window)
                regs, spill, listing = registers(ptxas, ptx, nvdisasm)
                loop = listing and loop_instructions(listing)
                threads = shape.tg * shape.groups
                blocks = 65536 // (-(-regs // 8) * 8 * threads)       # the register file: 64K a SM
                fmt = FORMATS[T[name]]
                loads = shape.nr * shape.unroll * fmt.chunk_words // 4      # 16-byte loads a lane, an iteration
                looped = fmt.row_words(n_in) // fmt.chunk_words > shape.tg * shape.unroll
                issue = ("" if not nvdisasm
                         else f" {loop:5} {loop / loads:8.0f} {4 * 32 * 16 * loads / loop:10.1f}" if looped
                         else f" {'-':>5} {'-':>8} {'-':>10}")      # one chunk a lane: no loop to count
                print(f"{name:6} {n_in:6} {n_out:6} {window:6} {shape.tg:4} {shape.nr:4} {regs:5} {spill:7}"
                      f" {blocks:9}" + issue, flush=True)
                if args.listing and listing:
                    print("\n".join(loop_listing(listing)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
