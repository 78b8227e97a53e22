# run 36: where a demo decode step that misses its cache spends the time (an event between nodes, 2 slots of
# 128 against every expert cached), then validate for the demo at 256 tokens (the bundled run-34 profile)
export NUMBA_ENABLE_CUDASIM=0
P=plans/hardware/h200-141g.yaml
nvidia-smi --query-gpu=name,clocks.current.sm,clocks.current.memory --format=csv | tee $OUT/gpu.txt
echo "== nodes $(date)"
timeout 150 python3 benchmarks/decode_nodes.py --model demo --demo-fractions 0.4 1.0 --prompt-tokens 256 768 > $OUT/nodes-demo.txt 2>&1; echo "rc $?"; cat $OUT/nodes-demo.txt | grep -v "^| blk\.[1-9]" | head -150
echo "== validate demo $(date)"
timeout 200 python3 benchmarks/validate.py --profile $P --model demo --prompts 256 --json $OUT/validate-demo-256.json > $OUT/validate-demo-256.txt 2>&1; echo "rc $?"; tail -25 $OUT/validate-demo-256.txt
echo "== end $(date)"
