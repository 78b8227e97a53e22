# run 37: a detect that fits decode_host_experts (both calibration models with no expert cached), then validate
# for the demo against it (every budget and length), then the demo's decode nodes at 40% / 100%
export NUMBA_ENABLE_CUDASIM=0
P=$OUT/h200-detected-2026-12-04-run37.yaml
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.current.sm,clocks.current.memory --format=csv | tee $OUT/gpu.txt
echo "== detect $(date)"
timeout 260 python3 -m planner.cli profile --detect -o $P --name h200-141g --samples $OUT/h200-samples-2026-12-04-run37.json > $OUT/detect.txt 2>&1; echo "detect rc $?"; tail -45 $OUT/detect.txt
[ -f $P ] || P=plans/hardware/h200-141g.yaml
LEFT=$(( 540 - ($(date +%s) - T0) ))
echo "== validate demo $(date), ${LEFT} s left, profile $P"
timeout $(( LEFT - 50 )) python3 benchmarks/validate.py --profile $P --model demo --json $OUT/validate-demo.json > $OUT/validate-demo.txt 2>&1; echo "rc $?"; tail -32 $OUT/validate-demo.txt
LEFT=$(( 560 - ($(date +%s) - T0) ))
echo "== nodes $(date), ${LEFT} s left"
timeout $LEFT python3 benchmarks/decode_nodes.py --model demo --profile $P --demo-fractions 0.4 1.0 --prompt-tokens 256 > $OUT/nodes-demo.txt 2>&1; echo "rc $?"; grep -v "^| blk\.[1-9]" $OUT/nodes-demo.txt | head -120
echo "== end $(date)"
