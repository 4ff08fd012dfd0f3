"""``runtime.make_checkpoint``: the offline checkpoint loads, tokenizes any text and
serves through ``runtime.serve --model DIR`` (the server tests serve it over HTTP)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
tokenizers = pytest.importorskip("tokenizers", reason="needs tokenizers (test extra)")

from runtime import make_checkpoint as mc  # noqa: E402
from runtime.checkpoints import load_checkpoint  # noqa: E402
from runtime.server.text import TextCodec  # noqa: E402
from tests.serve_cases import ROOT, run_serve  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("made") / "granite-tiny"
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.make_checkpoint", "granite-tiny", str(directory)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert name in proc.stdout  # it shows what it wrote
    return directory


def test_the_checkpoint_loads_as_a_supported_architecture(checkpoint) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["GraniteMoeHybridForCausalLM"]
    ckpt = load_checkpoint(checkpoint)
    assert ckpt.config.vocab_size == mc.VOCAB and ckpt.eos_token_ids == (257,)
    assert ckpt.tokenizer_path == checkpoint / "tokenizer.json"
    # transformers reads the same directory (weights, tokenizer, template).
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    assert model.config.num_hidden_layers == 4


def test_byte_level_tokenizer_round_trips_any_text(checkpoint) -> None:
    tok = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    text = "Grüße, 世界! \x00\ttabs\nand emoji \U0001f600"
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))  # one token per byte, id = byte value
    assert tok.decode(ids) == text
    assert tok.token_to_id(mc.EOS) == 257


def test_chat_template_matches_transformers(checkpoint) -> None:
    codec = TextCodec.from_checkpoint_dir(checkpoint, mc.VOCAB, (257,))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    hf = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert codec.encode_chat(messages) == list(expected)


def test_refuses_a_non_empty_directory(tmp_path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.make_checkpoint", "granite-tiny", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "not an empty directory" in proc.stderr and "Traceback" not in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_missing_transformers_names_the_extra(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[hf\]'"):
        mc.make_checkpoint("granite-tiny", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_serves_through_runtime_serve(checkpoint, tmp_path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"text": "The cache keeps what it has seen. " * 3, "session": "a"},
        {"text": " Again, please.", "session": "a"},
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["--model", str(checkpoint), "--prompts", str(prompts), "--page-size", "8"]
    args += ["--storage-root", str(tmp_path / "l3")]
    cached, _ = run_serve(tmp_path, "full", *args)
    off, _ = run_serve(tmp_path, "off", *args, "--cache", "off")
    tok = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    for a, b in zip(cached["requests"], off["requests"], strict=True):
        assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 4
        assert a["output_text"] == tok.decode(a["output_ids"])
    assert cached["summary"]["cached_device"] > 0  # the second turn hit its history
