# Run 53: three changes that take work off a decode step's critical path, A/B/C on one machine:
#   base  `.base/`    = `git archive 8b54070` (main before them);
#   mid   `.var/mid/` = `git archive 2c970a8`: the K/V store folded into the RoPE launch (12 -> 11 launches a
#         block), and the routed ids written by the routing launch into mapped host memory, where the step had
#         a device-to-host copy node after each MoE block's routing (6 a step here, 48 for the full model);
#   new   this tree: also decode attention keeping 8 K chunks and 16 V rows in flight for f16 (4 and 8 before),
#         a tile's chain of load rounds 8 -> 4 at head dim 128.
# (each of .base/ and .var/mid/ holds codegen, planner, runtime, benchmarks/*.py, plans/hardware, plans/models;
# carried.) Each runs the resident Qwen-shaped decode (e2e, 6 blocks, the h200-141g plan, f16 K/V) twice, in
# turns; the first run pays the compile. The tokens' digest must be the same for all three (the same bits).
# Then the GPU tests of the changed kernels. Usage, from the repository root on the device, after DEVICE.md's
# prefix: bash benchmarks/results/run53/run53.sh. The kernel cache goes back as $OUT/kc.tgz (see run52.sh).
export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=/tmp/kc
[ -f .var/kc.tgz ] && tar xzf .var/kc.tgz -C /tmp
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
. benchmarks/device_step.sh
E2E="python3 benchmarks/e2e.py --layers 6 --plans h200-141g --prompt-tokens 1984 --new-tokens 32"
tree() { echo "cd ${1:-.} && PYTHONPATH=/tmp/site:$PWD/${1:-.} $E2E"; }
TAIL=6 step e2e-new-1.txt 150 bash -c "$(tree)"
TAIL=6 step e2e-base-1.txt 90 bash -c "$(tree .base)"
TAIL=6 step e2e-mid-1.txt 60 bash -c "$(tree .var/mid)"
TAIL=6 step e2e-new-2.txt 45 bash -c "$(tree)"
TAIL=6 step e2e-base-2.txt 45 bash -c "$(tree .base)"
TAIL=6 step e2e-mid-2.txt 45 bash -c "$(tree .var/mid)"
step gpu-tests.txt 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_pointwise.py \
    tests/test_attention.py -k "gpu_rope or (gpu_decode and (f16 or q8_0))"
tar czf $OUT/kc.tgz -C /tmp kc && du -h $OUT/kc.tgz
