# Run 51 (to run): what main's last two changes were not checked on: the overlapping decode matmul's merged form
# (the wait's 0 joined only to the activations' lane) and Q5_K. Chain and Q5_K tests first, then the tables.
# Usage, from the repository root on the device, after DEVICE.md's prefix: bash benchmarks/results/run51/run51.sh
export NUMBA_ENABLE_CUDASIM=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
. benchmarks/device_step.sh
step gpu_chain.log 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_matmul.py -k chain
step gpu_q5k.log 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_matmul.py -k "real_shape and Q5_K"
TAIL=12 step decode.txt 150 python3 benchmarks/kernels_matmul.py decode --types Q4_0,Q8_0,Q5_K \
    --shapes 768x2048,4096x4096,12288x4096,4096x12288
step e2e.txt 150 python3 benchmarks/e2e.py --layers 6 --plans h200-141g --prompt-tokens 1984 --new-tokens 32
