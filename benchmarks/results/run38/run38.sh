# run 38 (2026-12-05): a detect on a cold machine (run 37's was cut off at 260 s), then validate for the demo and
# for the Qwen shape against it on the same machine, in the time left. The kernel cache comes back as one archive
# ($OUT/kernel-cache.tar.gz); later calls unpack it into .kernel-cache and skip compiling. The rest comes back as
# $OUT/run38.tar.gz (a call brings back 8 files at most).
export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=$PWD/.kernel-cache
mkdir -p $STRATUM_KERNEL_CACHE
W=/tmp/run38; mkdir -p $W
P=$W/h200-detected-2026-12-05-run38.yaml
T0=$(date +%s)
left() { echo $(( 575 - ($(date +%s) - T0) )); }
pack() { tar -czf $OUT/run38.tar.gz -C $W . ; tar -czf $OUT/kernel-cache.tar.gz -C $STRATUM_KERNEL_CACHE . ; }
trap pack EXIT
nvidia-smi --query-gpu=name,clocks.current.sm,clocks.current.memory --format=csv | tee $W/gpu.txt
echo "== detect $(date)"
timeout 420 python3 -m planner.cli profile --detect -o $P --name h200-141g --samples $W/h200-samples-run38.json \
  > $W/detect.txt 2>&1; echo "detect rc $?"; grep -v "Warning\|warn(" $W/detect.txt | tail -40
grep -q decode_host_experts $P || exit 3
[ $(left) -gt 60 ] || exit 0
echo "== validate demo $(date), $(left) s left"
timeout $(( $(left) - 5 )) python3 benchmarks/validate.py --profile $P --model demo --json $W/validate-demo.json \
  > $W/validate-demo.txt 2>&1; echo "rc $?"; tail -24 $W/validate-demo.txt
[ $(left) -gt 60 ] || exit 0
echo "== validate qwen shape $(date), $(left) s left"
timeout $(( $(left) - 5 )) python3 benchmarks/validate.py --profile $P --json $W/validate.json \
  > $W/validate.txt 2>&1; echo "rc $?"; tail -24 $W/validate.txt
echo "== end $(date)"
