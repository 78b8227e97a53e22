# run 41 (2026-12-06, H100 80GB): run 40 measured the decode-norm fusion 6% slower. Here validate's resident
# node table (h200-141g profile, budget 141, one prompt of 512, a one-prompt trace) for both sides, fused (this tree)
# and `.base/` (git archive 3383fa8), to see which launches lost; then the production decode and prefill matmul
# tables (now with Q4_K) in the time left. The kernel cache (carried as .kernel-cache) is run 40's.
export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=$PWD/.kernel-cache
W=/tmp/run41; mkdir -p $W
T0=$(date +%s)
left() { echo $(( 575 - ($(date +%s) - T0) )); }
trap 'tar -czf $OUT/run41.tar.gz -C $W .' EXIT
for side in fused base; do
  dir=$PWD; [ $side = base ] && dir=$PWD/.base
  echo "== validate $side $(date), $(left) s left"
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 170 python3 benchmarks/validate.py \
     --profile plans/hardware/h200-141g.yaml --budgets 141 --prompts 512 --trace-prompts 1 --json $W/validate-$side.json) \
     > $W/validate-$side.txt 2>&1; echo "rc $?"; grep -v "Warning\|warn(" $W/validate-$side.txt | tail -30
done
echo "== kernels decode, prefill $(date), $(left) s left"
timeout $(( $(left) - 5 )) python3 benchmarks/kernels_matmul.py decode prefill > $W/kernels.txt 2>&1; echo "rc $?"
grep -v "Warning\|warn(" $W/kernels.txt | tail -40
echo "== end $(date)"
