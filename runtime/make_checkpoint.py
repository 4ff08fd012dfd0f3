"""Write a tiny random Hugging Face checkpoint that ``runtime.serve`` and
``runtime.server`` can serve offline (nothing is downloaded).

``python -m runtime.make_checkpoint granite-tiny DIR`` builds the model from
transformers' own config class, draws random weights (seeded) at a scale that gives
non-trivial logits, and saves it with ``save_pretrained`` (``config.json`` +
``model.safetensors``). Beside it go a byte-level ``tokenizer.json`` (every byte is a
token, so any text round-trips; ``tokenizers`` library) and ``tokenizer_config.json``
with a chat template and the special tokens. The weights are random: the text it
generates is noise, but every code path of a real checkpoint runs (text in and out,
chat template, end-of-sequence, tensor-parallel slicing).

transformers is needed only here: ``pip install -e '.[hf]'``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BOS, EOS, PAD, RESERVED = "<|start|>", "<|end|>", "<|pad|>", "<|reserved|>"
"""Special tokens: ids 256-259, after the 256 byte tokens."""
VOCAB = 260
"""Model vocabulary: 256 bytes and the four special tokens (divisible by tp 1, 2, 4)."""
CHAT_TEMPLATE = (
    "{% for m in messages %}" + BOS + "{{ m['role'] }}\n{{ m['content'] }}" + EOS + "\n"
    "{% endfor %}{% if add_generation_prompt %}" + BOS + "assistant\n{% endif %}"
)
EXTRA = "pip install -e '.[hf]'"


def _granite_tiny(transformers: Any) -> Any:
    """A Granite 4.0-H-like hybrid: Mamba-2 and attention (no RoPE), MoE with a shared
    MLP, multipliers != 1 (untied embeddings: tied ones make a random model echo its
    last input token)."""
    return transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "mamba"],
        num_hidden_layers=4,
        mamba_n_heads=8,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_head=16,
        mamba_chunk_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        shared_intermediate_size=64,
        position_embedding_type="nope",
        tie_word_embeddings=False,
        embedding_multiplier=2.0,
        attention_multiplier=0.25,
        residual_multiplier=0.6,
        logits_scaling=2.0,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    )


MODELS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "granite-tiny": ("GraniteMoeHybridForCausalLM", _granite_tiny),
}
"""Name -> (transformers model class, config builder)."""


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise SystemExit(
            f"runtime.make_checkpoint: error: needs transformers (the hf extra): {EXTRA}"
        ) from None
    return transformers


def _redraw(model: Any, seed: int) -> None:
    """Seeded random weights: transformers' 0.02 init gives near-constant logits."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":  # decay rates exp(A) in [1, 16]
                p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=gen)))
            elif leaf == "D":
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif leaf == "dt_bias":  # softplus(dt_bias) in [1e-3, 1e-1], log-uniform
                lo, hi = math.log(1e-3), math.log(1e-1)
                dt = torch.exp(lo + (hi - lo) * torch.rand(p.shape, generator=gen))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def byte_level_tokenizer() -> Any:
    """A ``tokenizers.Tokenizer``: one token per byte (ids 0-255), then the specials."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise SystemExit(
            f"runtime.make_checkpoint: error: needs tokenizers (the hf extra): {EXTRA}"
        ) from None
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    vocab = {char: i for i, char in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS, PAD, RESERVED])
    return tok


def _byte_of(char: str) -> int:
    """The byte GPT-2's byte-level alphabet maps to ``char`` (printable bytes map to
    themselves; the others to code points 256 and up, in byte order)."""
    code = ord(char)
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    if code < 256 and code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def make_checkpoint(name: str, directory: Path, seed: int = 0) -> list[Path]:
    """Write checkpoint ``name`` into ``directory`` (created; must be empty if it exists).
    Returns the files written. ``FileExistsError`` for a non-empty directory."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise FileExistsError(f"{directory} exists and is not an empty directory")
    transformers = _import_transformers()
    model_class, build_config = MODELS[name]
    tokenizer = byte_level_tokenizer()
    model = getattr(transformers, model_class)(build_config(transformers)).eval()
    _redraw(model, seed)
    directory.mkdir(parents=True, exist_ok=True)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return sorted(p for p in directory.iterdir() if p.is_file())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m runtime.make_checkpoint",
        description="Write a tiny random Hugging Face checkpoint with a byte-level "
        "tokenizer and a chat template, servable offline with --model DIR.",
    )
    p.add_argument("model", choices=sorted(MODELS), help="which architecture")
    p.add_argument("directory", type=Path, help="where to write it (new or empty)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        files = make_checkpoint(args.model, args.directory, args.seed)
    except (FileExistsError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    model_class = MODELS[args.model][0]
    print(f"wrote a random {model_class} ({args.model}, seed {args.seed}) to {args.directory}:")
    for path in files:
        print(f"  {path.name:<24} {path.stat().st_size:>10,} bytes")
    print(f"serve it: python -m runtime.serve --model {args.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
