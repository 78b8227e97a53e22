# run 45 (2026-12-06): Q4_K decode after its header became one 16-byte load (registers 167 -> 106 at 4096 x 12288,
# benchmarks/registers.py). The matmul gpu tests at real shapes, the production decode table (every type), then the
# resident Q8_0 engine end to end. Everything comes back as $OUT/run45.tar.gz.
export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=/tmp/kc
W=/tmp/run45; mkdir -p $W
T0=$(date +%s)
left() { echo $(( 575 - ($(date +%s) - T0) )); }
trap 'tar -czf $OUT/run45.tar.gz -C $W .' EXIT
nvidia-smi --query-gpu=name,clocks.current.sm,clocks.current.memory --format=csv | tee $W/gpu.txt
echo "== gpu tests $(date)"
timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_matmul.py -k "real_shape" \
  > $W/gpu-tests.txt 2>&1; echo "rc $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" $W/gpu-tests.txt | tail -12
echo "== kernels decode $(date), $(left) s left"
timeout 240 python3 benchmarks/kernels_matmul.py decode > $W/kernels.txt 2>&1; echo "rc $?"
grep -v "Warning\|warn(" $W/kernels.txt | tail -30
echo "== e2e q8_0 $(date), $(left) s left"
timeout $(( $(left) - 5 )) python3 benchmarks/e2e.py --card qwen3-30b-a3b-q8_0 --layers 6 --plans h200-141g \
  --prompt-tokens 1984 --new-tokens 32 > $W/e2e-q8_0.txt 2>&1; echo "rc $?"; grep -v "Warning\|warn(" $W/e2e-q8_0.txt | tail -3
echo "== end $(date)"
