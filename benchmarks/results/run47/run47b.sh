# run 47b: the MoE decode step, new tree against .base (run 47's assertion on the routed ids failed in both
# trees: the 8th chosen expert's logit, 3, was beaten by a random one; now 13), then the moe GPU tests.
export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=/tmp/kc
W=/tmp/run47b; mkdir -p $W
T0=$(date +%s)
left() { echo $(( 470 - ($(date +%s) - T0) )); }
trap 'tar -czf $OUT/run47b.tar.gz -C $W .' EXIT
echo "== moe new $(date)"
timeout 150 python3 benchmarks/kernels_matmul.py moe > $W/moe-new.txt 2>&1; echo "rc $?"
grep -v "Warning\|warn(" $W/moe-new.txt | tail -14
echo "== moe base $(date), $(left) s left"
PYTHONPATH=/tmp/site:$PWD/.base timeout 150 python3 .base/benchmarks/kernels_matmul.py moe > $W/moe-base.txt 2>&1
echo "rc $?"; grep -v "Warning\|warn(" $W/moe-base.txt | tail -14
echo "== gpu tests $(date), $(left) s left"
timeout $(( $(left) - 5 )) python3 -m pytest -q -m gpu tests/test_moe.py tests/test_matmul.py -x > $W/gpu-tests.txt 2>&1
echo "rc $?"; tail -5 $W/gpu-tests.txt
echo "== end $(date)"
