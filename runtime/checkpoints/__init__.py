"""Hugging Face checkpoints: one adapter per architecture and a loader.

Supported: the hybrids ``GraniteMoeHybridForCausalLM`` (dense and MoE),
``BambaForCausalLM``, ``NemotronHForCausalLM``, ``JambaForCausalLM`` (Mamba-1), the Gated
DeltaNet and MLA families, LFM2's short convolutions (``Lfm2ForCausalLM``), Falcon-H1's
parallel attention + Mamba-2 layers (``FalconH1ForCausalLM``), the windowed
``GptOssForCausalLM`` and ``Gemma3ForCausalLM``, and the dense attention decoders
``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``Qwen3MoeForCausalLM``. Needs ``safetensors`` (``pip install -e '.[hf]'``)::

    ckpt = load_checkpoint("/models/granite-4.0-h-tiny")
    model = HybridModel(ckpt.config, topology, weights=ckpt.weights)
"""

from __future__ import annotations

from runtime.checkpoints.loader import (
    SUPPORTED,
    Checkpoint,
    ModelChoice,
    choose_model,
    load_checkpoint,
)

__all__ = ["SUPPORTED", "Checkpoint", "ModelChoice", "choose_model", "load_checkpoint"]
