# Run 53: two changes that take work off a decode step's critical path, A/B/C on one machine:
#   base  `.base/` = `git archive 8b54070` (main before both);
#   mid   `.mid/`  = `git archive ef65640`: the K/V store folded into the RoPE launch (12 -> 11 launches a block);
#   new   this tree: also the routed ids written by the routing launch into mapped host memory, where the step
#         had a device-to-host copy node after each MoE block's routing (6 a step here, 48 for the full model).
# (each of .base/ and .mid/ holds codegen, planner, runtime, benchmarks/*.py, plans/hardware, plans/models; carried.)
# Each runs the resident Qwen-shaped decode (e2e, 6 blocks, the h200-141g plan) twice, in turns; the first run
# pays the compile. The tokens' digest must be the same for all three (the same bits). Then the fused kernel's
# GPU test. Usage, from the repository root on the device, after DEVICE.md's prefix:
# bash benchmarks/results/run53/run53.sh. The kernel cache goes back as $OUT/kc.tgz (see run52.sh).
export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=/tmp/kc
[ -f .var/kc.tgz ] && tar xzf .var/kc.tgz -C /tmp
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
. benchmarks/device_step.sh
E2E="python3 benchmarks/e2e.py --layers 6 --plans h200-141g --prompt-tokens 1984 --new-tokens 32"
tree() { echo "cd ${1:-.} && PYTHONPATH=/tmp/site:$PWD/${1:-.} $E2E"; }
TAIL=6 step e2e-new-1.txt 150 bash -c "$(tree)"
TAIL=6 step e2e-base-1.txt 90 bash -c "$(tree .base)"
TAIL=6 step e2e-mid-1.txt 60 bash -c "$(tree .mid)"
TAIL=6 step e2e-new-2.txt 50 bash -c "$(tree)"
TAIL=6 step e2e-base-2.txt 50 bash -c "$(tree .base)"
TAIL=6 step e2e-mid-2.txt 50 bash -c "$(tree .mid)"
step rope.txt 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_pointwise.py -k gpu_rope
tar czf $OUT/kc.tgz -C /tmp kc && du -h $OUT/kc.tgz
