# run 35: where the router launch's time goes (a bisecting probe), then validate both models against run 34's
# detected profile (priced with its read and zero-copy latencies)
export NUMBA_ENABLE_CUDASIM=0
T0=$(date +%s)
P=benchmarks/results/run34/h200-detected-2026-12-04-run34.yaml
echo "== probe $(date)"
timeout 45 python3 benchmarks/results/run35/router-bisect.py 2>&1 | grep -v Warn | tee $OUT/router-bisect.txt
echo "== demo $(date)"
timeout 150 python3 benchmarks/validate.py --profile $P --model demo --json $OUT/validate-2026-12-04-demo-run35.json > $OUT/validate-demo.txt 2>&1; echo "rc $?"; tail -24 $OUT/validate-demo.txt
LEFT=$(( 365 - ($(date +%s) - T0) ))
echo "== qwen $(date), ${LEFT} s left"
timeout $LEFT python3 benchmarks/validate.py --profile $P --json $OUT/validate-2026-12-04-run35.json > $OUT/validate.txt 2>&1; echo "rc $?"; tail -24 $OUT/validate.txt
echo "== end $(date)"
