# run 38: run 37's detect again with more time (it was cut off at 260 s while compiling on a cold machine), then
# validate for the demo against it in the same call (same machine), at 256 and 768 tokens
export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=$OUT/kernel-cache   # brought back: later sessions carry it
P=$OUT/h200-detected-2026-12-04-run38.yaml
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.current.sm,clocks.current.memory --format=csv | tee $OUT/gpu.txt
echo "== detect $(date)"
timeout 490 python3 -m planner.cli profile --detect -o $P --name h200-141g --samples $OUT/h200-samples-2026-12-04-run38.json > $OUT/detect.txt 2>&1; echo "detect rc $?"; grep -v "Warning\|warn(" $OUT/detect.txt | tail -42
grep -q decode_host_experts $P || exit 3
LEFT=$(( 515 - ($(date +%s) - T0) ))
[ $LEFT -gt 90 ] || exit 0
echo "== validate demo $(date), ${LEFT} s left"
timeout $LEFT python3 benchmarks/validate.py --profile $P --model demo --prompts 256 768 --json $OUT/validate-demo.json > $OUT/validate-demo.txt 2>&1; echo "rc $?"; tail -22 $OUT/validate-demo.txt
echo "== end $(date)"
