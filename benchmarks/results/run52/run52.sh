# Run 52 (to run): what run 51 (BENCHMARKS.md) left unmeasured, most needed first: the chain test at window 8
# in the merged form, the resident e2e (tokens' digest should stay acf9b3d32fb8), Q5_K's decode rows, the
# decode step's per-node breakdown (step limits summing to 400 s). The profiles' missing Q5_K decode rate needs a
# detect, a call of its own (~312 s): `python3 -m planner.cli profile --detect -o P --name h100-80g`.
# Usage, from the repository root on the device, after DEVICE.md's prefix: bash benchmarks/results/run52/run52.sh
# Fresh machines spend most of a call compiling, so the kernel cache travels: a `.var/kc.tgz` that a previous
# call returned (copy it from that call's files into the gitignored `.var/`, then carry [".whl", ".var"]) is
# unpacked first, and the cache as it ends up goes back as $OUT/kc.tgz ($OUT returns at most 8 files).
. benchmarks/device_step.sh
begin_call
step chain8.log 75 python3 -m pytest -m gpu -q -p no:cacheprovider \
    "tests/test_matmul.py::test_gpu_decode_chain_of_overlapping_kernels[8]"
TAIL=30 step e2e.txt 200 python3 benchmarks/e2e.py --layers 6 --plans h200-141g --prompt-tokens 1984 --new-tokens 32
TAIL=12 step q5k.txt 55 python3 benchmarks/kernels_matmul.py decode --types Q5_K \
    --shapes 768x2048,4096x4096,12288x4096,4096x12288
TAIL=40 step nodes.txt 70 python3 benchmarks/decode_nodes.py --layers 6 --prompt-tokens 1984
end_call
