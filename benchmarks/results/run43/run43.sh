# run 43 (2026-12-06, a later session): Q6_K. The gpu tests of every matmul and embedding real shape (now with
# Q6_K), the production decode and prefill matmul tables (now with Q6_K), then the engine end to end on the
# Qwen3-30B-A3B Q4_K_M card's types (Q4_K, Q6_K where llama.cpp puts it; 6 blocks, resident) beside the Q8_0
# card in the same call. Everything comes back as $OUT/run43.tar.gz.
export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=/tmp/kc
W=/tmp/run43; mkdir -p $W
T0=$(date +%s)
left() { echo $(( 575 - ($(date +%s) - T0) )); }
trap 'tar -czf $OUT/run43.tar.gz -C $W .' EXIT
nvidia-smi --query-gpu=name,clocks.current.sm,clocks.current.memory --format=csv | tee $W/gpu.txt
echo "== gpu tests $(date)"
timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_matmul.py tests/test_pointwise.py \
  -k "real_shape or embed" > $W/gpu-tests.txt 2>&1; echo "rc $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" \
  $W/gpu-tests.txt | tail -20
for card in qwen3-30b-a3b-q4_k_m qwen3-30b-a3b-q8_0; do
  echo "== e2e $card $(date), $(left) s left"
  timeout 150 python3 benchmarks/e2e.py --card $card --layers 6 --plans h200-141g --prompt-tokens 1984 \
    --new-tokens 32 > $W/e2e-$card.txt 2>&1; echo "rc $?"; grep -v "Warning\|warn(" $W/e2e-$card.txt | tail -3
done
echo "== kernels decode, prefill $(date), $(left) s left"
timeout $(( $(left) - 5 )) python3 benchmarks/kernels_matmul.py decode prefill > $W/kernels.txt 2>&1; echo "rc $?"
grep -v "Warning\|warn(" $W/kernels.txt | tail -50
echo "== end $(date)"
