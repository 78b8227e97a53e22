# Run 55 (to run): the decode matmul's deferred scale conversion (`deferred-scales.patch` beside this script)
# against main. The patch converts a prefetched chunk's scales after the current chunks' arithmetic (main
# converts them at the load, so a lane waits out the prefetch there), folds window row 0's test, and has a lane
# that loops prefetch unconditionally; ptxas: fewer loop instructions, a block an SM more for most looping
# kernels at window 1, lanes of one chunk as on main (BENCHMARKS.md). Here, first:
#   bash benchmarks/base_tree.sh HEAD                          (.base/ = main)
#   git apply benchmarks/results/run55/deferred-scales.patch  (this tree = the candidate; `git checkout codegen`
#                                                              after the call)
# and copy a kernel cache that a previous call returned into .var/kc.tgz if there is one. Then one call from the
# repository root on the device after DEVICE.md's prefix, carrying [".whl", ".base", ".var"]:
#   bash benchmarks/results/run55/run55.sh
# Each side: the dense decode table and the MoE decode step (`kernels_matmul.py decode moe`), then the resident
# e2e, whose tokens' digest must be the same on both sides (the patch keeps the bits).
. benchmarks/device_step.sh
begin_call
SHAPES=768x2048,4096x4096,12288x4096,4096x12288
TABLES="python3 benchmarks/kernels_matmul.py decode moe --types Q4_0,Q8_0,Q4_K,Q5_K --shapes $SHAPES"
E2E="python3 benchmarks/e2e.py --layers 6 --plans h200-141g --prompt-tokens 1984 --new-tokens 32"
TAIL=30 step tables-new.txt 150 $TABLES
TAIL=30 step tables-base.txt 150 bash -c "$(in_base "$TABLES")"
TAIL=6 step e2e-new.txt 120 $E2E
TAIL=6 step e2e-base.txt 70 bash -c "$(in_base "$E2E")"
end_call
