"""Tiny random checkpoints for ``scripts/bench_vllm.py``, built by transformers (no hub).

    python scripts/bench_vllm_models.py OUT_DIR granite|llama [--wide]

Run with the Python whose transformers vLLM loads (the vLLM venv): the saved
``config.json`` is then one that both vLLM and ``runtime.checkpoints`` read.

- ``granite``: a Granite-4.0-H-style hybrid (Mamba-2 + attention + MoE, no RoPE, tied
  embeddings) with ``mamba_chunk_size`` 128: vLLM's CPU build crashes with prefix caching on
  a Mamba-2 hybrid unless the chunk size equals its block size (128).
- ``llama``: a plain ``LlamaForCausalLM`` (dense attention, GQA, RoPE).

Small: hidden 128 (the per-operation overhead decides). ``--wide``: about 100M parameters
(hidden 1024, compute decides). Weights are redrawn with a fan-in scale so greedy tokens
depend on the prompt (transformers' 0.02 init gives near-constant logits). No end of
sequence token (``eos_token_id`` None): every request runs to ``max_tokens`` in every server.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

VOCAB = 512


def granite_config(wide: bool) -> Any:
    import transformers

    hidden, layers, experts = (1024, 8, 8) if wide else (128, 4, 4)
    heads = hidden // 64
    kinds = ["mamba", "attention", "mamba", "mamba"] * (layers // 4)
    return transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB * (8 if wide else 1),
        hidden_size=hidden,
        num_hidden_layers=layers,
        layer_types=kinds,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        mamba_n_heads=hidden * 2 // 64,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=64 if wide else 16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=128,
        num_local_experts=experts,
        num_experts_per_tok=2,
        intermediate_size=hidden // 2 if wide else 64,
        shared_intermediate_size=hidden if wide else 128,
        position_embedding_type="nope",
        tie_word_embeddings=True,
        embedding_multiplier=2.0,
        attention_multiplier=1.0 / math.sqrt(64),
        residual_multiplier=0.5,
        logits_scaling=2.0,
        max_position_embeddings=8192,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )


def llama_config(wide: bool) -> Any:
    import transformers

    hidden, layers = (1024, 8) if wide else (128, 4)
    heads = hidden // 64
    return transformers.LlamaConfig(
        vocab_size=VOCAB * (8 if wide else 1),
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )


def redraw(model: Any, seed: int) -> None:
    """Non-trivial random weights: fan-in scaled matrices, unit embeddings, norms near 1,
    Mamba-2's ``A_log``, ``D`` and ``dt_bias`` in their usual ranges."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 15 + 1))
            elif leaf == "D":
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif leaf == "dt_bias":
                dt = torch.exp(torch.rand(p.shape, generator=gen) * math.log(100) + math.log(1e-3))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def build(out: Path, kind: str, wide: bool, seed: int = 0) -> Path:
    """Save the checkpoint under ``out`` (once: an existing one is kept) and return it."""
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers

    config = granite_config(wide) if kind == "granite" else llama_config(wide)
    cls = (
        transformers.GraniteMoeHybridForCausalLM
        if kind == "granite"
        else transformers.LlamaForCausalLM
    )
    torch.manual_seed(seed)
    model = cls(config).eval()
    redraw(model, seed)
    model.save_pretrained(out)
    # No generation_config stop ids either: both servers run to max_tokens.
    gen = out / "generation_config.json"
    if gen.is_file():
        data = json.loads(gen.read_text())
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            data.pop(key, None)
        gen.write_text(json.dumps(data, indent=2))
    params = sum(p.numel() for p in model.parameters())
    print(f"{kind}{' wide' if wide else ''}: {params / 1e6:.1f}M parameters in {out}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("kind", choices=("granite", "llama"))
    p.add_argument("--wide", action="store_true", help="about 100M parameters")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    build(a.out, a.kind, a.wide, a.seed)


if __name__ == "__main__":
    main()
