"""Every kernel benchmark, on a real GPU: each figure a fraction of a ceiling measured in the same run.

    NUMBA_ENABLE_CUDASIM=0 PYTHONPATH=. python3 benchmarks/kernels.py

First the ceilings (device read bandwidth, FP32 peak: runtime/ceilings.py), then the matmul tables (decode
GEMV per weight type and shape, the MoE decode step of one layer, prefill GEMM; numbered versions first) and
the attention tables (decode attention over 32K tokens of K/V; prefill attention).
"""

from benchmarks import kernels_attention, kernels_matmul
from runtime import ceilings


def main():
    ceilings.main()
    kernels_matmul.main()
    kernels_attention.main()


if __name__ == "__main__":
    main()
