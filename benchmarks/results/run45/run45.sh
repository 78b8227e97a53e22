# run 45 (2026-12-07): the decode matmul's bit fields read in one lop3 each (`cuda.field_reader`; 4-bit types
# 4 -> 3 instructions a value) against the tree before it (.base = git archive 1c87c74 of codegen, runtime,
# planner, plans; carried), which also has Q4_K's header as one 16-byte load (registers 167 -> 106 at 4096 x
# 12288, benchmarks/registers.py). Then the resident engine end to end on Qwen3-30B-A3B's Q4_K_M types (Q6_K
# down projections in some blocks, Q4_K in the rest: refused by the engine before 1c87c74), 6 blocks.
# Everything comes back as $OUT/run45.tar.gz.
export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=/tmp/kc
W=/tmp/run45; mkdir -p $W
T0=$(date +%s)
left() { echo $(( 575 - ($(date +%s) - T0) )); }
trap 'tar -czf $OUT/run45.tar.gz -C $W .' EXIT
nvidia-smi --query-gpu=name,clocks.current.sm,clocks.current.memory --format=csv | tee $W/gpu.txt
TABLE="decode --types Q8_0,Q4_0,Q4_K,Q6_K --shapes 4096x4096,12288x4096,4096x12288,151936x4096"
echo "== kernels decode, new $(date)"
timeout 190 python3 benchmarks/kernels_matmul.py $TABLE > $W/kernels-new.txt 2>&1; echo "rc $?"
grep -v "Warning\|warn(" $W/kernels-new.txt | tail -22
echo "== kernels decode, base $(date), $(left) s left"
PYTHONPATH=/tmp/site:$PWD/.base timeout 190 python3 .base/benchmarks/kernels_matmul.py $TABLE > $W/kernels-base.txt 2>&1
echo "rc $?"; grep -v "Warning\|warn(" $W/kernels-base.txt | tail -22
echo "== e2e q4_k_m $(date), $(left) s left"
timeout $(( $(left) - 5 )) python3 benchmarks/e2e.py --card qwen3-30b-a3b-q4_k_m --layers 6 --plans h200-141g \
  --prompt-tokens 1984 --new-tokens 32 > $W/e2e-q4_k_m.txt 2>&1; echo "rc $?"; grep -v "Warning\|warn(" $W/e2e-q4_k_m.txt | tail -12
echo "== end $(date)"
