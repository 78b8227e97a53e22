# Sourced by the device run scripts under benchmarks/results/:
# - `begin_call` / `end_call`: the kernel cache in /tmp/kc, unpacked from the `.var/kc.tgz` a previous call returned
#   (copy it from that call's files into the gitignored .var/ and carry ".var") and returned as $OUT/kc.tgz, so a
#   later call does not compile cold; the GPU's name into $OUT/gpu.txt; then the number of entries in the cache
#   every 20 s (run 53's cut-off processes appeared to store none; one file, as $OUT returns 8 at most);
# - `step NAME LIMIT command...` runs the command under a time limit with its output in $OUT/NAME, then prints its
#   exit status, seconds and last $TAIL lines (4 unless set), so the call's output_tail shows every step even
#   when a later one is cut off;
# - `in_base "command"`: the command line that runs it in `.base/` (`benchmarks/base_tree.sh`), for `bash -c`.
begin_call() {
    export NUMBA_ENABLE_CUDASIM=0 STRATUM_KERNEL_CACHE=/tmp/kc
    [ -f .var/kc.tgz ] && tar xzf .var/kc.tgz -C /tmp
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
    (while :; do echo "$SECONDS s: $(ls /tmp/kc 2>/dev/null | wc -l) entries"; sleep 20; done) >> $OUT/gpu.txt &
    KC_WATCH=$!
}
end_call() {
    kill $KC_WATCH; tail -1 $OUT/gpu.txt
    tar czf $OUT/kc.tgz -C /tmp kc && du -h $OUT/kc.tgz
}
step() {
    local name=$1 limit=$2; shift 2
    local started=$SECONDS
    timeout $limit "$@" > $OUT/$name 2>&1
    echo "== $name (rc $?, $((SECONDS - started)) s)"; tail -${TAIL:-4} $OUT/$name
}
in_base() {
    echo "cd .base && PYTHONPATH=/tmp/site:$PWD/.base $1"
}
