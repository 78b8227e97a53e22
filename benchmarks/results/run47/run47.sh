# run 47 (2026-12-07): the decode kernels' rows addressed from one base a matrix (a group's rows consecutive;
# the matrix's last group takes its last nr rows) instead of each row clamped to the matrix: ptxas puts Q4_0
# and Q8_0 at 72-78 registers, not 92-94 (3 blocks an SM, not 2). The new tree against the one before it
# (.base = git archive a0e6d8a of codegen, runtime, planner, plans, benchmarks; carried), decode table and the
# MoE decode step; then the GPU tests of matmul and moe. Everything comes back as $OUT/run47.tar.gz.
export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=/tmp/kc
W=/tmp/run47; mkdir -p $W
T0=$(date +%s)
left() { echo $(( 575 - ($(date +%s) - T0) )); }
trap 'tar -czf $OUT/run47.tar.gz -C $W .' EXIT
nvidia-smi --query-gpu=name,clocks.current.sm,clocks.current.memory --format=csv | tee $W/gpu.txt
ARGS="decode moe --types Q8_0,Q4_0,Q4_K,Q6_K --shapes 4096x4096,12288x4096,4096x12288,151936x4096,768x2048"
echo "== new $(date)"
timeout 200 python3 benchmarks/kernels_matmul.py $ARGS > $W/kernels-new.txt 2>&1; echo "rc $?"
grep -v "Warning\|warn(" $W/kernels-new.txt | tail -32
echo "== base $(date), $(left) s left"
PYTHONPATH=/tmp/site:$PWD/.base timeout 200 python3 .base/benchmarks/kernels_matmul.py $ARGS > $W/kernels-base.txt 2>&1
echo "rc $?"; grep -v "Warning\|warn(" $W/kernels-base.txt | tail -32
echo "== gpu tests $(date), $(left) s left"
timeout $(( $(left) - 5 )) python3 -m pytest -q -m gpu tests/test_matmul.py tests/test_moe.py -x > $W/gpu-tests.txt 2>&1
echo "rc $?"; tail -5 $W/gpu-tests.txt
echo "== end $(date)"
