# run 40 (2026-12-06, first device call in four sessions; the machine lent is an H100, not the H200 of every
# earlier run, so every figure is against a baseline from this same call). 1) the decode-norm fusion A/B on one
# machine: `.base/` (carried) is `git archive 3383fa8` (main before f78cff7); each side runs the resident
# Qwen-shaped decode (e2e, 6 blocks, the h200-141g plan: it fits 80 GB at 6 blocks) twice, the first run paying
# the compile. 2) the gpu tests of the fused kernels and of Q4_K, in the time left. The kernel cache comes back
# as $OUT/kernel-cache.tar.gz (carry it to the next call as .kernel-cache); the rest as $OUT/run40.tar.gz.
export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=$PWD/.kernel-cache
mkdir -p $STRATUM_KERNEL_CACHE
W=/tmp/run40; mkdir -p $W
T0=$(date +%s)
left() { echo $(( 575 - ($(date +%s) - T0) )); }
trap 'tar -czf $OUT/run40.tar.gz -C $W . ; tar -czf $OUT/kernel-cache.tar.gz -C $STRATUM_KERNEL_CACHE .' EXIT
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.memory --format=csv | tee $W/gpu.txt
for run in 1 2; do
  for side in fused base; do
    dir=$PWD; [ $side = base ] && dir=$PWD/.base
    echo "== e2e $side run $run $(date), $(left) s left"
    (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 130 python3 benchmarks/e2e.py --layers 6 --plans h200-141g \
       --prompt-tokens 1984 --new-tokens 32) > $W/e2e-$side-$run.txt 2>&1; echo "rc $?"
    grep -v "Warning\|warn(" $W/e2e-$side-$run.txt | tail -8
  done
  [ $(left) -gt 300 ] || break
done
echo "== gpu tests $(date), $(left) s left"
timeout $(( $(left) - 10 )) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_matmul.py tests/test_moe.py \
  -k "Q4_K or qkv or qwen3_30b" > $W/gpu-tests.txt 2>&1; echo "rc $?"; tail -8 $W/gpu-tests.txt
echo "== end $(date)"
