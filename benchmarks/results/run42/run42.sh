# run 42 (2026-12-06, H100 80GB): main after the decode-norm fusion's revert, with Q4_K: the resident
# Qwen-shaped decode once more (e2e, 6 blocks, the h200-141g plan; run 40's unfused side was 1322-1339 tok/s),
# then the gpu tests that did not finish in run 40 (the MoE real shapes) and the whole-pass gpu checks, in the
# time left. Everything comes back as $OUT/run42.tar.gz.
export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=$PWD/.kernel-cache
W=/tmp/run42; mkdir -p $W
T0=$(date +%s)
left() { echo $(( 540 - ($(date +%s) - T0) )); }
trap 'tar -czf $OUT/run42.tar.gz -C $W .' EXIT
echo "== e2e $(date)"
timeout 200 python3 benchmarks/e2e.py --layers 6 --plans h200-141g --prompt-tokens 1984 --new-tokens 32 \
  > $W/e2e.txt 2>&1; echo "rc $?"; grep -v "Warning\|warn(" $W/e2e.txt | tail -4
echo "== gpu tests $(date), $(left) s left"
timeout $(( $(left) - 5 )) python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_moe.py tests/test_program.py \
  -k "qwen3_30b or program" > $W/gpu-tests.txt 2>&1; echo "rc $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" \
  $W/gpu-tests.txt | tail -12
echo "== end $(date)"
