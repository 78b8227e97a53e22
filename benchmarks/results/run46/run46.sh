# run 46 (2026-12-07): the lent machine is an H100, and every prediction so far was priced with the H200's
# profile. A full detect here, now with the decode matmul's read rate for each weight type
# (`runtime.decode_rates`, the candidate plans/hardware/h100-80g.yaml); then the resident Q4_K_M shape
# validated against it (its decode was predicted +66% with the H200 profile and no rates, run 45). Everything
# comes back as $OUT/run46.tar.gz.
export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=/tmp/kc
W=/tmp/run46; mkdir -p $W
P=$W/h100-80g.yaml
T0=$(date +%s)
left() { echo $(( 580 - ($(date +%s) - T0) )); }
trap 'tar -czf $OUT/run46.tar.gz -C $W .' EXIT
nvidia-smi --query-gpu=name,clocks.current.sm,clocks.current.memory --format=csv | tee $W/gpu.txt
echo "== detect $(date)"
timeout 440 python3 -m planner.cli profile --detect -o $P --name h100-80g --samples $W/h100-samples-run46.json \
  > $W/detect.txt 2>&1; echo "detect rc $?"; grep -v "Warning\|warn(" $W/detect.txt | tail -16
grep -q decode_weight_rates $P || exit 3
echo "== validate q4_k_m $(date), $(left) s left"
timeout $(( $(left) - 5 )) python3 benchmarks/validate.py --profile $P --card qwen3-30b-a3b-q4_k_m --budgets 141 \
  --prompts 1984 --no-trace --json $W/validate-q4_k_m.json > $W/validate-q4_k_m.txt 2>&1; echo "rc $?"
grep -v "Warning\|warn(" $W/validate-q4_k_m.txt | tail -8
echo "== end $(date)"
