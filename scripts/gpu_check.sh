#!/usr/bin/env bash
# The prepared GPU check (issue 11 item 7): run on a CUDA machine from anywhere,
#
#     scripts/gpu_check.sh [RESULT.json]        # default: gpu_check.json
#
# Steps, each under its own timeout (at most 7 minutes in all):
#   1. tests/gpu          : CUDA transfer engine, cupy pinned host pools, NCCL variants
#                           of the distributed tests that fit the GPUs present
#   2. bench_transfer     : CUDA engine (cupy pinned host pools) vs plain pinned
#                           cudaMemcpy through torch pin_memory tensors, both directions,
#                           page sizes 16/64/256 tokens
#   3. serve_cpu/serve_gpu: one-rank runtime.serve, once with CUDA hidden and once on
#                           the GPU; then serve_compare checks the output ids are equal
# Writes one JSON (steps with status, seconds, exit code and a log tail; the bench's
# and serve's own results are embedded) and exits 1 if any step failed.
# Without CUDA (or without cupy) it stops at once with exit 2 and says why.
#
# Python: $PYTHON, else .venv/bin/python when its torch sees CUDA, else python3.
set -u
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULT="$(realpath -m "${1:-gpu_check.json}")"
cd "$REPO" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# give_up REASON: no step can run here; say why, leave a JSON saying so, exit 2.
give_up() {
    echo "gpu_check: $1" >&2
    mkdir -p "$(dirname "$RESULT")"
    printf '{"ok": false, "error": "%s", "steps": []}\n' "${1//\"/\'}" >"$RESULT"
    exit 2
}
has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x .venv/bin/python ] && has_cuda .venv/bin/python; then
    PY=.venv/bin/python
else
    PY=python3
    [ -x .venv/bin/python ] && echo "gpu_check: .venv/bin/python sees no CUDA; trying python3" >&2
fi
command -v "$PY" >/dev/null 2>&1 || give_up "no python '$PY' (set PYTHON=...)"
"$PY" -c 'import torch' 2>/dev/null || give_up "$PY cannot import torch (set PYTHON=...)"
has_cuda "$PY" || give_up "torch in $PY sees no CUDA device: run this on a CUDA machine"
"$PY" -c 'import sys; from mesh_hicache.pools import cupy_cuda_available as c; sys.exit(not c())' ||
    give_up "cupy is missing in $PY or sees no CUDA device; the CUDA engine needs it"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
STEPS="$WORK/steps.tsv"
: >"$STEPS"
FAILED=0

# step NAME TIMEOUT_S CMD...: run CMD under a timeout, log to $WORK/NAME.log, record it.
step() {
    local name="$1" limit="$2"
    shift 2
    echo "== $name (timeout ${limit}s): $*"
    local start end rc
    start=$(date +%s.%N)
    timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
    end=$(date +%s.%N)
    tail -n 15 "$WORK/$name.log"
    if [ "$rc" -ne 0 ]; then
        FAILED=1
        [ "$rc" -eq 124 ] && echo "!! $name timed out after ${limit}s"
        echo "!! $name failed (exit $rc)"
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$start" "$end" >>"$STEPS"
}

step tests_gpu 120 "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu
step bench_transfer 120 "$PY" scripts/bench_transfer.py --device cuda --page-sizes 16,64,256 \
    --repeats 5 --max-repeats 30 --fixed-repeats 100 --json "$WORK/bench_transfer.json"
SERVE=(-m runtime.serve --sessions 3 --turns 3 --first-prompt-len 96 --append-len 24
    --max-new-tokens 6 --device-pages 16 --cache host --quiet)
step serve_cpu 75 env CUDA_VISIBLE_DEVICES= "$PY" "${SERVE[@]}" --json "$WORK/serve_cpu.json"
step serve_gpu 75 "$PY" "${SERVE[@]}" --json "$WORK/serve_gpu.json"
step serve_compare 20 "$PY" - "$WORK/serve_cpu.json" "$WORK/serve_gpu.json" <<'EOF'
import json, sys
cpu, gpu = (json.load(open(p)) for p in sys.argv[1:3])
a = [(r["id"], r["output_ids"]) for r in cpu["requests"]]
b = [(r["id"], r["output_ids"]) for r in gpu["requests"]]
same = sum(x == y for x, y in zip(a, b))
print(f"{same}/{len(a)} requests with equal output ids (CPU vs CUDA)")
for name, run in (("cpu", cpu), ("cuda", gpu)):
    s = run["summary"]
    print(f"{name}: served from L1 {s['cached_device']}, from L2 {s['cached_host']} tokens")
for x, y in zip(a, b):
    if x != y:
        print(f"request {x[0]}: cpu {x[1]} != cuda {y[1]}")
sys.exit(0 if a == b and a else 1)
EOF

"$PY" - "$STEPS" "$WORK" "$RESULT" "$PY" <<'EOF'
import json, os, platform, sys
steps_path, work, result, py = sys.argv[1:5]
import torch
steps = []
for line in open(steps_path):
    name, rc, start, end = line.rstrip("\n").split("\t")
    log = open(os.path.join(work, name + ".log"), errors="replace").read().splitlines()
    steps.append({
        "name": name,
        "ok": rc == "0",
        "exit_code": int(rc),
        "timed_out": rc in ("124", "137"),
        "seconds": round(float(end) - float(start), 2),
        "log_tail": log[-40:],
    })
def load(name):
    path = os.path.join(work, name)
    return json.load(open(path)) if os.path.exists(path) else None
serve = {k: load(f"serve_{k}.json") for k in ("cpu", "gpu")}
out = {
    "ok": all(s["ok"] for s in steps),
    "machine": {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "python_path": py,
    },
    "steps": steps,
    "bench_transfer": load("bench_transfer.json"),
    "serve_summary": {k: (v or {}).get("summary") for k, v in serve.items()},
}
os.makedirs(os.path.dirname(result) or ".", exist_ok=True)
with open(result, "w") as f:
    json.dump(out, f, indent=2)
print(f"gpu_check: {'all steps passed' if out['ok'] else 'FAILED'}; results in {result}")
EOF
[ $? -eq 0 ] || FAILED=1
exit "$FAILED"
