# run 44 (prepared 2026-12-06, not yet run: no device time left): the lent machine is an H100 now, and every prediction so far was priced
# with the H200's profile. A full detect here (the candidate plans/hardware/h100-80g.yaml), then validate for the
# Qwen shape against it at three budgets in the time left. Everything comes back as $OUT/run44.tar.gz.
export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=/tmp/kc
W=/tmp/run44; mkdir -p $W
P=$W/h100-80g.yaml
T0=$(date +%s)
left() { echo $(( 575 - ($(date +%s) - T0) )); }
trap 'tar -czf $OUT/run44.tar.gz -C $W .' EXIT
nvidia-smi --query-gpu=name,clocks.current.sm,clocks.current.memory --format=csv | tee $W/gpu.txt
echo "== detect $(date)"
timeout 360 python3 -m planner.cli profile --detect -o $P --name h100-80g --samples $W/h100-samples-run44.json \
  > $W/detect.txt 2>&1; echo "detect rc $?"; grep -v "Warning\|warn(" $W/detect.txt | tail -30
grep -q decode_host_experts $P || exit 3
echo "== validate qwen shape $(date), $(left) s left"
timeout $(( $(left) - 5 )) python3 benchmarks/validate.py --profile $P --budgets 80 16 8 --json $W/validate.json \
  > $W/validate.txt 2>&1; echo "rc $?"; grep -v "Warning\|warn(" $W/validate.txt | tail -24
echo "== end $(date)"
