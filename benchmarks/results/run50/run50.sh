# Run 50: overlapping launches (branch decode-pdl). Trees: the working tree (every decode-step kernel
# `overlapping`), .a1/ (7629fae: the dense decode matmul only), .base/ (main), .var/ (7629fae with the wait's 0
# not joined to the lane: loads ordered after the wait by program order alone). Chain tests first.
# Usage, from the repository root on the device, after DEVICE.md's prefix: bash benchmarks/results/run50/run50.sh [steps]
root=$PWD
export NUMBA_ENABLE_CUDASIM=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
in_tree() {  # in_tree DIR NAME command...: run with DIR's packages and its own kernel cache, output to $OUT/NAME
    local dir=$1 name=$2; shift 2
    local started=$SECONDS
    (cd $dir && PYTHONPATH=/tmp/site:$PWD STRATUM_KERNEL_CACHE=/tmp/kc-$(basename $dir) timeout ${LIMIT:-200} "$@") \
        > $OUT/$name 2>&1
    echo "== $name (rc $?, $((SECONDS - started)) s)"; tail -${TAIL:-6} $OUT/$name
}
shapes="--types Q4_0,Q8_0,Q4_K --shapes 768x2048,4096x4096,12288x4096,4096x12288"
e2e="benchmarks/e2e.py --layers 6 --plans h200-141g --prompt-tokens 1984 --new-tokens 32"
chain="python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_matmul.py -k chain"
for step in ${@:-chain e2e decode}; do
    case $step in
    chain) LIMIT=200 in_tree $root gpu_chain.log $chain ;;
    e2e) TAIL=4 in_tree $root e2e_all.txt python3 $e2e
         TAIL=4 in_tree $root/.base e2e_base.txt python3 $e2e ;;
    decode) TAIL=14 LIMIT=120 in_tree $root decode_all.txt python3 benchmarks/kernels_matmul.py decode $shapes
            TAIL=14 LIMIT=120 in_tree $root/.base decode_base.txt python3 benchmarks/kernels_matmul.py decode $shapes ;;
    e2e-8g) TAIL=4 LIMIT=170 in_tree $root e2e8g_all.txt python3 ${e2e/h200-141g/rtx-2060-super-8g}
            TAIL=4 LIMIT=170 in_tree $root/.base e2e8g_base.txt python3 ${e2e/h200-141g/rtx-2060-super-8g} ;;
    dense) shapes="--types Q4_0,Q8_0 --shapes 768x2048,4096x4096,12288x4096,4096x12288"
           TAIL=10 LIMIT=110 in_tree $root decode2_all.txt python3 benchmarks/kernels_matmul.py decode $shapes
           TAIL=10 LIMIT=110 in_tree $root/.base decode2_base.txt python3 benchmarks/kernels_matmul.py decode $shapes ;;
    moe) TAIL=12 LIMIT=120 in_tree $root moe_all.txt python3 benchmarks/kernels_matmul.py moe
         TAIL=12 LIMIT=120 in_tree $root/.base moe_base.txt python3 benchmarks/kernels_matmul.py moe ;;
    e2e-a1) TAIL=4 in_tree $root/.a1 e2e_a1.txt python3 $e2e ;;
    var) LIMIT=150 in_tree $root/.var gpu_chain_var.log python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_matmul.py -k "chain and 3"
         TAIL=10 LIMIT=110 in_tree $root/.var decode_var.txt python3 benchmarks/kernels_matmul.py decode ${shapes/Q4_0,Q8_0,Q4_K/Q4_0,Q8_0} ;;
    engine) LIMIT=400 in_tree $root gpu_engine.log python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_engine.py -k drafting ;;
    esac
done
