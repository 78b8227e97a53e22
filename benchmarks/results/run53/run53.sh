# Run 53: four changes that take work off a decode step's critical path, A/B on one machine against `.base/`
# = `git archive 8b54070` (main before them; codegen, planner, runtime, tools, benchmarks/*.py, plans/hardware,
# plans/models; carried):
#   - the K/V store folded into the RoPE launch (12 -> 11 launches a block);
#   - the routed ids written by the routing launch into mapped host memory, where the step had a device-to-host
#     copy node after each MoE block's routing (6 a step here, 48 for the full model);
#   - decode attention keeping 8 K chunks and 16 V rows in flight for f16 (4 and 8 before): a tile's chain of
#     load rounds 8 -> 4 at head dim 128;
#   - the argmax in 38 blocks a row, then a merge that writes the greedy token into mapped host memory (one block
#     a row read the 151936 logits in 9.8 us; and no copy node after the step).
# Each side runs the resident Qwen-shaped decode (e2e, 6 blocks, the h200-141g plan, f16 K/V) twice, in turns;
# the first run pays the compile; the tokens' digest must be the same on both sides (the same bits). The GPU
# tests of the changed kernels run after the first, and the per-node times of a step after 1984 positions on
# both sides last. Usage, from the repository root on the device, after DEVICE.md's prefix:
# bash benchmarks/results/run53/run53.sh. The kernel cache goes back as $OUT/kc.tgz (see run52.sh).
export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=/tmp/kc
[ -f .var/kc.tgz ] && tar xzf .var/kc.tgz -C /tmp
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
. benchmarks/device_step.sh
E2E="python3 benchmarks/e2e.py --layers 6 --plans h200-141g --prompt-tokens 1984 --new-tokens 32"
NODES="python3 benchmarks/decode_nodes.py --layers 6 --prompt-tokens 1984"
base() { echo "cd .base && PYTHONPATH=/tmp/site:$PWD/.base $1"; }
TAIL=6 step e2e-new-1.txt 150 $E2E
step gpu-tests.txt 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_pointwise.py \
    tests/test_attention.py -k "gpu_rope or gpu_argmax or (gpu_decode and (f16 or q8_0))"
TAIL=6 step e2e-base-1.txt 90 bash -c "$(base "$E2E")"
TAIL=6 step e2e-new-2.txt 45 $E2E
TAIL=6 step e2e-base-2.txt 45 bash -c "$(base "$E2E")"
TAIL=30 step nodes-new.txt 60 $NODES
TAIL=30 step nodes-base.txt 60 bash -c "$(base "$NODES")"
tar czf $OUT/kc.tgz -C /tmp kc && du -h $OUT/kc.tgz
