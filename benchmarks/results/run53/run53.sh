# Run 53: the K/V store folded into the RoPE launch (a decode block's launches 12 -> 11), A/B on one machine.
# `.base/` (carried) is `git archive 8b54070` of codegen, planner, runtime, benchmarks/*.py, plans/hardware,
# plans/models: main before the change. Each side runs the resident Qwen-shaped decode (e2e, 6 blocks, the
# h200-141g plan) twice, alternating; the first run pays the compile. The tokens' digest must be the same on
# both sides (the store's bits are the same). Then the fused kernel's GPU test and run 52's chain test at
# window 8. Usage, from the repository root on the device, after DEVICE.md's prefix:
# bash benchmarks/results/run53/run53.sh. The kernel cache goes back as $OUT/kc.tgz (see run52.sh).
export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=/tmp/kc
[ -f .var/kc.tgz ] && tar xzf .var/kc.tgz -C /tmp
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
. benchmarks/device_step.sh
E2E="python3 benchmarks/e2e.py --layers 6 --plans h200-141g --prompt-tokens 1984 --new-tokens 32"
BASE="cd .base && PYTHONPATH=/tmp/site:$PWD/.base $E2E"
TAIL=10 step e2e-new-1.txt 200 $E2E
TAIL=10 step e2e-base-1.txt 110 bash -c "$BASE"
TAIL=10 step e2e-new-2.txt 60 $E2E
TAIL=10 step e2e-base-2.txt 60 bash -c "$BASE"
step rope.txt 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_pointwise.py -k gpu_rope
step chain8.log 60 python3 -m pytest -m gpu -q -p no:cacheprovider \
    "tests/test_matmul.py::test_gpu_decode_chain_of_overlapping_kernels[8]"
tar czf $OUT/kc.tgz -C /tmp kc && du -h $OUT/kc.tgz
