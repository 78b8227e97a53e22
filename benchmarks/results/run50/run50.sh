# Run 50: the overlapping decode matmul (branch decode-pdl) against main (.base/), and a variant that orders its
# loads after the wait by program order alone (.var/: no 0 added to the lane). Chain test first on each.
# Usage, from the repository root on the device, after DEVICE.md's prefix: bash benchmarks/results/run50/run50.sh
root=$PWD
export NUMBA_ENABLE_CUDASIM=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
in_tree() {  # in_tree DIR NAME command...: run with DIR's packages and its own kernel cache, output to $OUT/NAME
    local dir=$1 name=$2; shift 2
    (cd $dir && PYTHONPATH=/tmp/site:$PWD STRATUM_KERNEL_CACHE=/tmp/kc-$(basename $dir) timeout ${LIMIT:-200} "$@") \
        > $OUT/$name 2>&1
    echo "== $name (rc $?)"; tail -${TAIL:-6} $OUT/$name
}
LIMIT=240 in_tree $root gpu_A.log python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_matmul.py -k "chain or real_shape or qkv"
LIMIT=120 in_tree $root/.var gpu_B.log python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_matmul.py -k chain
shapes="--types Q4_0,Q8_0,Q4_K --shapes 768x2048,4096x4096,12288x4096,4096x12288"
TAIL=20 in_tree $root decode_A.txt python3 benchmarks/kernels_matmul.py decode $shapes
TAIL=20 in_tree $root/.base decode_base.txt python3 benchmarks/kernels_matmul.py decode $shapes
TAIL=20 in_tree $root/.var decode_B.txt python3 benchmarks/kernels_matmul.py decode $shapes
e2e="benchmarks/e2e.py --layers 6 --plans h200-141g --prompt-tokens 1984 --new-tokens 32"
TAIL=12 in_tree $root e2e_A.txt python3 $e2e
TAIL=12 in_tree $root/.base e2e_base.txt python3 $e2e
