"""Load a Hugging Face checkpoint directory: pick the adapter, derive the config.

``load_checkpoint(path)`` reads ``config.json``, finds the adapter of its architecture
(a clear ``ValueError`` lists the supported ones otherwise), derives the
:class:`~runtime.model.ModelConfig` and returns a :class:`Checkpoint` whose ``weights``
the model reads slice by slice (``HybridModel(config, topo, weights=ckpt.weights)``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.checkpoints import (
    bamba,
    deepseek_v32,
    gemma3,
    gpt_oss,
    granitemoehybrid,
    nemotron_h,
    qwen3_next,
)
from runtime.checkpoints.base import (
    Adapter,
    CheckpointWeights,
    SafetensorsFiles,
    file_digest,
    parse_dtype,
)
from runtime.model.config import PRESETS, ModelConfig, preset
from runtime.model.weights import WeightSource

_ALL: tuple[Adapter, ...] = (
    granitemoehybrid.ADAPTER,
    bamba.ADAPTER,
    nemotron_h.ADAPTER,
    *qwen3_next.ADAPTERS,
    deepseek_v32.ADAPTER,
    gpt_oss.ADAPTER,
    gemma3.ADAPTER,
)
ADAPTERS: dict[str, Adapter] = {a.architecture: a for a in _ALL}
SUPPORTED = tuple(sorted(ADAPTERS))


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint ready to serve: its model config, its weights, its tokenizer file."""

    path: Path
    architecture: str
    config: ModelConfig
    weights: CheckpointWeights
    tokenizer_path: Path | None
    """``tokenizer.json`` when the directory has one."""
    eos_token_id: int | None


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None) -> Checkpoint:
    """Open the checkpoint in directory ``path`` (``config.json`` + ``*.safetensors``).

    ``dtype``: float32 or bfloat16 for weights and activations (default: the
    checkpoint's; float16 checkpoints run in float32). Reads no tensor data yet.
    """
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"--model {str(path)!r}: no config.json (a preset name or a checkpoint dir)"
        )
    hf = json.loads(config_file.read_text())
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in ADAPTERS:
        raise ValueError(
            f"architecture {arch!r} of {directory} is not supported; supported: {SUPPORTED}"
        )
    adapter = ADAPTERS[arch]
    name = f"{hf.get('model_type', arch)}-{file_digest(directory)}"
    config = adapter.model_config(hf, dtype or parse_dtype(hf), name)
    weights = CheckpointWeights(SafetensorsFiles(directory), adapter, config, hf)
    tokenizer = directory / "tokenizer.json"
    eos = hf.get("eos_token_id")
    return Checkpoint(
        path=directory,
        architecture=arch,
        config=config,
        weights=weights,
        tokenizer_path=tokenizer if tokenizer.is_file() else None,
        eos_token_id=eos if isinstance(eos, int) else None,
    )


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """What a ``--model`` flag names: a preset (seeded weights) or a checkpoint."""

    config: ModelConfig
    weights: WeightSource | None
    """None: the preset's seeded weights."""
    checkpoint: Checkpoint | None


def choose_model(model: str, dtype: torch.dtype, seed: int = 0) -> ModelChoice:
    """``model`` is a preset name (``tiny``, ``small``) or a checkpoint directory."""
    if model in PRESETS:
        return ModelChoice(preset(model, dtype=dtype, seed=seed), None, None)
    if not Path(model).is_dir():
        raise ValueError(
            f"--model {model!r} is neither a preset {sorted(PRESETS)} nor a checkpoint directory"
        )
    ckpt = load_checkpoint(model, dtype)
    return ModelChoice(ckpt.config, ckpt.weights, ckpt)
