# run 45 (2026-12-06): Q4_K decode after its header became one 16-byte load (registers 167 -> 106 at 4096 x 12288,
# benchmarks/registers.py). The matmul gpu tests at real shapes, the production decode table (every type), then the
# resident engine end to end on Qwen3-30B-A3B's Q4_K_M types (Q6_K down projections in some blocks, Q4_K in the
# rest: refused by the engine before 2026-12-07), 6 blocks. Everything comes back as $OUT/run45.tar.gz.
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
echo "== e2e q4_k_m $(date), $(left) s left"
timeout $(( $(left) - 5 )) python3 benchmarks/e2e.py --card qwen3-30b-a3b-q4_k_m --layers 6 --plans h200-141g \
  --prompt-tokens 1984 --new-tokens 32 > $W/e2e-q4_k_m.txt 2>&1; echo "rc $?"; grep -v "Warning\|warn(" $W/e2e-q4_k_m.txt | tail -12
echo "== end $(date)"
