#!/usr/bin/env bash
# Run the serving, transfer and radix benchmarks; write bench_results/ (git-ignored).
#
#   scripts/bench_all.sh                 # full run (small model; minutes on 2 CPU cores)
#   QUICK=1 scripts/bench_all.sh         # smoke-sized run (tiny model, small trees)
#   OUT=/tmp/results PYTHON=python3 scripts/bench_all.sh
#
# Each benchmark writes <name>.json in the shared format (scripts/bench_common.py) and
# its printed report to <name>.txt. Extra arguments go to bench_serving.py.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-bench_results}"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
    if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
fi
mkdir -p "$out"

if [[ -n "${QUICK:-}" ]]; then
    serving_args=(--model tiny --sessions 2 --turns 2 --first-prompt-len 64 --device-pages 9
        --prefetch-threshold 16)
    transfer_args=(--pages 16 --repeats 2)
    radix_args=(--sessions 100 --turns 4)
else
    serving_args=()
    transfer_args=()
    radix_args=()
fi

run() {
    local name="$1"
    shift
    echo "== $name: $*"
    "$py" "$@" | tee "$out/$name.txt"
}

# The TTFT plot needs matplotlib: the `plot` extra (pip install -e '.[plot]').
plot_args=(--plot "$out/serving_ttft.png")
if ! "$py" -c "import matplotlib" 2>/dev/null; then
    echo "== no TTFT plot: matplotlib is missing; install it with: pip install -e '.[plot]'"
    plot_args=()
fi
run serving scripts/bench_serving.py "${serving_args[@]}" --json "$out/serving.json" \
    "${plot_args[@]}" "$@"
run transfer scripts/bench_transfer.py "${transfer_args[@]}" --json "$out/transfer.json"
run radix scripts/bench_radix.py "${radix_args[@]}" --json "$out/radix.json"
echo "== results in $out/"
ls -1 "$out"
