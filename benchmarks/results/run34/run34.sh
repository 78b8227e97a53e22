# run 34: the block router (router v3) on the H200: GPU tests, the routing probe, decode nodes, e2e, then a full
# detect with what time is left
export NUMBA_ENABLE_CUDASIM=0
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.current.sm,clocks.current.memory --format=csv | tee $OUT/gpu.txt
echo "== tests $(date)"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_pointwise.py tests/test_matmul.py -k "route or router or topk" 2>&1 | tail -15 | tee $OUT/gpu-tests.txt
echo "== probe $(date)"
timeout 60 python3 benchmarks/results/route-probe-2026-12-03-run33.py 2>&1 | tee $OUT/route-probe.txt
echo "== nodes $(date)"
timeout 170 python3 benchmarks/decode_nodes.py --layers 6 --prompt-tokens 512 16384 > $OUT/nodes.txt 2>&1; grep -E "moe_route|attention|step|decode step|^\| (all|total)" $OUT/nodes.txt | head -30
echo "== e2e $(date)"
timeout 60 python3 benchmarks/e2e.py --layers 6 --new-tokens 32 --prompt-tokens 1984 --plans h200-141g > $OUT/e2e.txt 2>&1; tail -4 $OUT/e2e.txt
LEFT=$(( 560 - ($(date +%s) - T0) ))
echo "== detect $(date), ${LEFT} s left"
timeout $LEFT python3 -m planner.cli profile --detect -o $OUT/h200-detected-2026-12-04-run34.yaml --name h200-141g --samples $OUT/h200-samples-2026-12-04-run34.json > $OUT/detect.txt 2>&1; echo "detect rc $?"; tail -40 $OUT/detect.txt
echo "== end $(date)"
ls -la $OUT
