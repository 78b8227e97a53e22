# run 39: the decode norms fused into the matmuls that read them, A/B on one machine. `.base/` (carried) is
# main before the fusion (git archive 3383fa8 | tar -x -C .base); both run the resident Qwen-shaped decode
# (e2e, 6 blocks, h200-141g), then the gpu tests of the fused kernels, then the MoE decode sweep (unroll 1/2/4).
# Everything comes back as $OUT/run39.tar.gz.
export NUMBA_ENABLE_CUDASIM=0
W=/tmp/run39; mkdir -p $W
T0=$(date +%s)
left() { echo $(( 575 - ($(date +%s) - T0) )); }
trap 'tar -czf $OUT/run39.tar.gz -C $W .' EXIT
nvidia-smi --query-gpu=name,clocks.current.sm,clocks.current.memory --format=csv | tee $W/gpu.txt
for side in base fused; do
  dir=$PWD; [ $side = base ] && dir=$PWD/.base
  echo "== e2e $side $(date), $(left) s left"
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 150 python3 benchmarks/e2e.py --layers 6 --plans h200-141g \
     --prompt-tokens 512 --new-tokens 64) > $W/e2e-$side.txt 2>&1; echo "rc $?"; grep -v "Warning\|warn(" \
     $W/e2e-$side.txt | tail -14
done
echo "== gpu tests $(date), $(left) s left"
timeout $(( $(left) - 150 )) python3 -m pytest -q -m gpu tests/test_matmul.py tests/test_moe.py -k "qkv or fused or moe" \
  > $W/gpu-tests.txt 2>&1; echo "rc $?"; tail -6 $W/gpu-tests.txt
echo "== moe sweep $(date), $(left) s left"
timeout $(( $(left) - 5 )) python3 benchmarks/kernels_matmul.py moe-sweep > $W/moe-sweep.txt 2>&1; echo "rc $?"
tail -30 $W/moe-sweep.txt
echo "== end $(date)"
