# Sourced by the device run scripts under benchmarks/results/: `step NAME LIMIT command...` runs the command
# under a time limit with its output in $OUT/NAME, then prints its exit status, seconds and last $TAIL lines
# (4 unless set), so the call's output_tail shows every step even when a later one is cut off.
step() {
    local name=$1 limit=$2; shift 2
    local started=$SECONDS
    timeout $limit "$@" > $OUT/$name 2>&1
    echo "== $name (rc $?, $((SECONDS - started)) s)"; tail -${TAIL:-4} $OUT/$name
}
