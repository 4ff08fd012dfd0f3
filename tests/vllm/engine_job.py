"""Runs one vLLM engine over a list of requests (inside the vLLM venv) and prints JSON.

Usage: ``python engine_job.py JOB.json OUT.json``. The job names the model directory,
dtype, block size, device blocks, the kv_transfer_config (or none) and the steps; each step
is one request (token ids, cache_salt, max_tokens) run to completion before the next,
optionally after emptying vLLM's own prefix cache (``reset_device_cache``). Per
step the output holds the greedy tokens, each token's logprob, the connector's counters
after it and the L3 files present once the store is quiet.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _read_stats(path: str | None) -> dict:
    out: dict = {}
    if not path:
        return out
    for p in sorted(Path(path).parent.glob(Path(path).name + "*")):
        if p.name.endswith(".json") or ".worker" in p.name:
            try:
                out.update(json.loads(p.read_text()))
            except (OSError, ValueError):
                pass
    return out


def _quiet_files(root: str | None, stats_file: str | None, timeout_s: float = 60.0) -> list[str]:
    """The L3 object files once nothing changed for 1.5 s (saves are asynchronous)."""
    if not root:
        return []
    last: tuple = ()
    stable_since = time.monotonic()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = tuple(
            sorted(
                str(p.relative_to(root))
                for p in Path(root).rglob("*")
                if p.is_file() and ".tmp" not in p.name
            )
        )
        now = (files, json.dumps(_read_stats(stats_file), sort_keys=True))
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since > 1.5:
            break
        time.sleep(0.25)
    return list(last[0]) if last else []


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kv = job.get("kv_transfer_config")
    extra = (kv or {}).get("kv_connector_extra_config", {})
    kwargs = dict(job.get("engine_kwargs", {}))
    llm = LLM(
        model=job["model"],
        skip_tokenizer_init=True,
        dtype=job.get("dtype", "float32"),
        block_size=job.get("block_size", 32),
        enable_prefix_caching=True,
        max_model_len=job.get("max_model_len", 512),
        max_num_seqs=4,
        num_gpu_blocks_override=job.get("num_blocks"),
        kv_transfer_config=kv,
        seed=0,
        **kwargs,
    )
    steps_out = []
    for step in job["steps"]:
        if step.get("reset_device_cache"):  # vLLM's own prefix cache only (not the connector)
            assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
        sp = SamplingParams(max_tokens=step.get("max_tokens", 4), temperature=0.0, logprobs=1)
        prompt = TokensPrompt(prompt_token_ids=step["prompt"])
        if step.get("salt"):
            prompt["cache_salt"] = step["salt"]
        out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        logprobs = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs or [], strict=False)]
        files = _quiet_files(extra.get("storage_root"), extra.get("stats_file"))
        steps_out.append(
            {
                "tokens": list(out.token_ids),
                "logprobs": logprobs,
                "stats": _read_stats(extra.get("stats_file")),
                "files": files,
            }
        )
    Path(sys.argv[2]).write_text(json.dumps({"steps": steps_out}))
    del llm


if __name__ == "__main__":
    main()
