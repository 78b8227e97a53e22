# `bash benchmarks/base_tree.sh REV`: the gitignored `.base/` as the code of commit REV, for a device call's A/B
# against this tree (carry ".base"; run a command there as `cd .base && PYTHONPATH=/tmp/site:$PWD/.base ...`).
# It holds what the benchmarks import: codegen, planner, runtime, tools, benchmarks/*.py and the bundled
# profiles and model cards (a first copy made for run 53 lacked tools/, which benchmarks/decode_nodes.py imports).
set -e
rev=${1:?usage: bash benchmarks/base_tree.sh REV}
cd "$(git rev-parse --show-toplevel)"
rm -rf .base && mkdir .base
git archive "$rev" codegen planner runtime tools 'benchmarks/*.py' plans/__init__.py plans/hardware plans/models \
    pyproject.toml | tar -x -C .base
echo ".base/ is $(git rev-parse --short "$rev"): $(du -sh .base | cut -f1)"
