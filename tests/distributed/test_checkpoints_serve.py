"""``runtime.serve --model DIR --prompts P.jsonl`` equals transformers' greedy decoding.

End to end on a tiny random checkpoint built by transformers (Granite 4.0-H-like MoE
with one B/C group, tied embeddings, multipliers; Nemotron-H for the pipeline mesh) and
a word-level ``tokenizer.json``: the outputs of every request (session turns included:
history + answer + next line) are transformers' greedy tokens on the same prompts
(``greedy_reference``: full forwards without a KV cache, as ``generate(do_sample=False)``
chooses them), on one rank and under torchrun (1x2x2 and 2x1x1); a second run on the
same storage root reads L3 and still matches, also under another mesh (a reshard). The
dense attention decoders (Qwen3-MoE, Llama, Qwen2, Qwen3) run the same checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint_cases import build, greedy_reference, hf_model

tokenizers = pytest.importorskip("tokenizers", reason="needs tokenizers (test extra)")

ROOT = Path(__file__).resolve().parents[2]
WORDS = [f"w{i}" for i in range(1, 100)]


def _tokenizer(directory: Path) -> None:
    vocab = {"[UNK]": 0} | {w: i + 1 for i, w in enumerate(WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok.save(str(directory / "tokenizer.json"))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _requests() -> list[dict]:
    text = " ".join(WORDS[(7 * i) % 99] for i in range(40))
    return [
        {"input_ids": _ids(45, 1), "session": "a", "max_new_tokens": 6},
        {"text": text, "session": 7},
        {"input_ids": _ids(20, 2), "session": "a"},
        {"input_ids": _ids(33, 3)},
        {"input_ids": _ids(9, 4), "session": 7, "max_new_tokens": 3},
    ]


def _expected(directory: Path, requests: list[dict]) -> list[list[int]]:
    """transformers' greedy tokens per request, with session histories."""
    model = hf_model(directory)
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    history: dict[str, list[int]] = {}
    out = []
    for i, r in enumerate(requests):
        key = json.dumps(r["session"]) if "session" in r else f"line{i}"
        ids = r["input_ids"] if "input_ids" in r else tok.encode(r["text"]).ids
        prompt = history.get(key, []) + list(ids)
        n = r.get("max_new_tokens", 5)
        answer = greedy_reference(model, prompt, n)
        history[key] = prompt + answer
        out.append(answer)
    return out


def _serve(directory: Path, prompts: Path, storage: Path, out: Path, *mesh: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    nproc = 1
    for flag, value in zip(mesh[::2], mesh[1::2], strict=True):
        nproc *= int(value) if flag in ("--pp", "--cp", "--tp") else 1
    if nproc == 1:
        cmd = [sys.executable, "-m", "runtime.serve"]
    else:
        torchrun = Path(sys.executable).parent / "torchrun"
        if not torchrun.exists():
            pytest.skip("torchrun is not installed beside this interpreter")
        cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(nproc), "-m", "runtime.serve"]
    cmd += ["--model", str(directory), "--prompts", str(prompts), "--cache", "full"]
    cmd += ["--max-new-tokens", "5", "--page-size", "8", "--device-pages", "32"]
    cmd += ["--prefetch-threshold", "8", "--storage-root", str(storage), "--quiet"]
    cmd += ["--json", str(out), *mesh]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _setup(directory: Path, tmp_path: Path) -> tuple[Path, list[list[int]]]:
    """Give checkpoint ``directory`` the word-level tokenizer and write ``_requests()`` to
    ``tmp_path / "prompts.jsonl"``; returns that file and transformers' tokens per request."""
    _tokenizer(directory)
    requests = _requests()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in requests) + "\n")
    return prompts, _expected(directory, requests)


def _check_serve_twice(directory: Path, tmp_path: Path, *mesh: str) -> None:
    """``runtime.serve`` on ``mesh`` (CLI flags; none: one rank) gives transformers' greedy
    tokens and hits L1 on the second turn of session "a"; a new process on the same storage
    root (cold L1/L2, the prefixes come from L3) reads L3 and gives them again."""
    prompts, want = _setup(directory, tmp_path)
    storage = tmp_path / "l3"
    first = _serve(directory, prompts, storage, tmp_path / "first.json", *mesh)
    assert [r["output_ids"] for r in first["requests"]] == want
    assert first["requests"][2]["cached"]["device"] > 0  # the second turn of session "a"
    again = _serve(directory, prompts, storage, tmp_path / "again.json", *mesh)
    assert again["summary"]["cached_storage"] > 0
    assert [r["output_ids"] for r in again["requests"]] == want


def _check_l3_resharded(directory: Path, tmp_path: Path) -> None:
    """L3 written by one rank, then read by tp=2 (other head / channel slices per object)
    and by pp=2 (other layer ranges): transformers' tokens each time, with L3 hits that
    were resharded."""
    prompts, want = _setup(directory, tmp_path)
    storage = tmp_path / "l3"
    one = _serve(directory, prompts, storage, tmp_path / "one.json")
    assert [r["output_ids"] for r in one["requests"]] == want
    for name, mesh in (("tp2", ("--tp", "2")), ("pp2", ("--pp", "2"))):
        got = _serve(directory, prompts, storage, tmp_path / f"{name}.json", *mesh)
        assert [r["output_ids"] for r in got["requests"]] == want, name
        summary = got["summary"]
        assert summary["cached_storage"] > 0, name
        assert summary["storage_resharded_tokens"] > 0, name


@pytest.mark.parametrize(
    ("case", "mesh"),
    [
        ("granite_moe", ()),
        ("granite_moe", ("--cp", "2", "--tp", "2", "--cp-kv", "shard")),
        ("nemotron_h", ("--pp", "2")),
        ("qwen3_moe", ()),
        ("llama", ("--cp", "2", "--tp", "2", "--cp-kv", "shard")),
        ("qwen2", ("--pp", "2")),
    ],
    ids=["1rank", "1x2x2", "2x1x1", "qwen3_moe-1rank", "llama-1x2x2", "qwen2-2x1x1"],
)
def test_serve_prompts_equals_transformers_generate(tmp_path: Path, case: str, mesh) -> None:
    directory = build(case, tmp_path)
    prompts, want = _setup(directory, tmp_path)
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    storage = tmp_path / "l3"
    first = _serve(directory, prompts, storage, tmp_path / "first.json", *mesh)
    assert [r["output_ids"] for r in first["requests"]] == want
    assert [r["output_text"] for r in first["requests"]] == [tok.decode(w) for w in want]
    assert [r["session"] for r in first["requests"]][:3] == [0, 1, 0]
    assert first["requests"][2]["cached"]["device"] > 0  # the second turn of session "a"
    # A new process on the same storage root: cold L1/L2, the prefixes come from L3.
    again = _serve(directory, prompts, storage, tmp_path / "again.json", *mesh)
    assert again["summary"]["cached_storage"] > 0
    assert [r["output_ids"] for r in again["requests"]] == want


@pytest.mark.parametrize("case", ["qwen3", "granite_moe"])
def test_serve_reads_l3_across_a_reshard(tmp_path: Path, case: str) -> None:
    # L3 written by one rank, read by a tp=2 x cp=2 mesh: the same tokens as generate.
    directory = build(case, tmp_path)
    prompts, want = _setup(directory, tmp_path)
    storage = tmp_path / "l3"
    first = _serve(directory, prompts, storage, tmp_path / "first.json")
    assert [r["output_ids"] for r in first["requests"]] == want
    mesh = ("--cp", "2", "--tp", "2", "--cp-kv", "shard")
    again = _serve(directory, prompts, storage, tmp_path / "again.json", *mesh)
    summary = again["summary"]
    assert summary["cached_storage"] > 0
    assert summary["storage_resharded_tokens"] >= summary["cached_storage"]
    assert [r["output_ids"] for r in again["requests"]] == want
