# Run 54 (to run): run 53's A/B, which a cold machine could not do in one call (BENCHMARKS.md run 53: every e2e
# step was cut off while compiling). First, here: `bash benchmarks/base_tree.sh 8b54070` (main before the
# changes). Then from the repository root on the device after DEVICE.md's prefix, carrying [".whl", ".base",
# ".var"]:
#   bash benchmarks/results/run54/run54.sh 1   this tree's e2e from a cold cache (~100 s of compiling, 24 s of
#                                              weights), then `.base/`'s, which compiles only the kernels the
#                                              changes touched (a kernel's cache key is its code, not its
#                                              file); e2e times its requests after the engine's start, so a
#                                              cold run's figures count; returns the cache, $OUT/kc.tgz
#   (copy that kc.tgz into the gitignored .var/ before a second call)
#   bash benchmarks/results/run54/run54.sh 2   both sides again on the warm cache, each side's per-node times,
#                                              then what run52.sh left: the chain test at window 8 and Q5_K's
#                                              decode rows
# The tokens' digest must be the same on both sides (the changes keep the bits).
. benchmarks/device_step.sh
begin_call
E2E="python3 benchmarks/e2e.py --layers 6 --plans h200-141g --prompt-tokens 1984 --new-tokens 32"
NODES="python3 benchmarks/decode_nodes.py --layers 6 --prompt-tokens 1984"
if [ "$1" = 1 ]; then
    TAIL=6 step e2e-new-1.txt 320 $E2E
    TAIL=6 step e2e-base-1.txt 220 bash -c "$(in_base "$E2E")"
else
    TAIL=6 step e2e-new-2.txt 70 $E2E
    TAIL=6 step e2e-base-2.txt 70 bash -c "$(in_base "$E2E")"
    TAIL=30 step nodes-new.txt 110 $NODES
    TAIL=30 step nodes-base.txt 110 bash -c "$(in_base "$NODES")"
    step chain8.log 75 python3 -m pytest -m gpu -q -p no:cacheprovider \
        "tests/test_matmul.py::test_gpu_decode_chain_of_overlapping_kernels[8]"
    TAIL=12 step q5k.txt 55 python3 benchmarks/kernels_matmul.py decode --types Q5_K \
        --shapes 768x2048,4096x4096,12288x4096,4096x12288
fi
end_call
