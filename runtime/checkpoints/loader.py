"""Load a Hugging Face checkpoint directory: pick the adapter, derive the config.

``load_checkpoint(path)`` reads ``config.json``, finds the adapter of its architecture
(a clear ``ValueError`` lists the supported ones otherwise), derives the
:class:`~runtime.model.ModelConfig` and returns a :class:`Checkpoint` whose ``weights``
the model reads slice by slice (``HybridModel(config, topo, weights=ckpt.weights)``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mesh_hicache.identity import checkpoint_model_id
from runtime.checkpoints import (
    bamba,
    deepseek_v32,
    dense,
    falcon_h1,
    gemma3,
    gpt_oss,
    granitemoehybrid,
    jamba,
    lfm2,
    nemotron_h,
    qwen3_next,
)
from runtime.checkpoints.base import (
    Adapter,
    CheckpointWeights,
    SafetensorsFiles,
    parse_dtype,
)
from runtime.model.config import NUMERICS_VERSION, PRESETS, ModelConfig, preset
from runtime.model.weights import WeightSource

_ALL: tuple[Adapter, ...] = (
    granitemoehybrid.ADAPTER,
    bamba.ADAPTER,
    nemotron_h.ADAPTER,
    *qwen3_next.ADAPTERS,
    deepseek_v32.ADAPTER,
    *dense.ADAPTERS,
    gpt_oss.ADAPTER,
    gemma3.ADAPTER,
    jamba.ADAPTER,
    lfm2.ADAPTER,
    falcon_h1.ADAPTER,
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
    eos_token_ids: tuple[int, ...]
    """Where generation stops (:func:`stop_ids`); empty: nowhere."""


def load_checkpoint(
    path: str | Path,
    dtype: torch.dtype | None = None,
    *,
    model_id: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> Checkpoint:
    """Open the checkpoint in directory ``path`` (``config.json`` + ``*.safetensors``).

    ``dtype``: float32 or bfloat16 for weights and activations (default: the
    checkpoint's; float16 checkpoints run in float32). Reads no tensor data for the
    model yet, but hashes every weight file once (remembered per user, see
    ``mesh_hicache.identity``) for the identity in the storage keys.

    ``model_id``: the user's own identity of the weights (e.g. a hub repo and revision)
    instead of the content digest; keeping it unique to these exact weights is the
    user's responsibility. ``progress`` receives the hashing progress lines.
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
    dtype = dtype or parse_dtype(hf)
    # Validate the config and find the weights before hashing gigabytes.
    config = adapter.model_config(hf, dtype, "unhashed")
    files = SafetensorsFiles(directory)
    config = replace(config, name=weights_name(directory, arch, dtype, model_id, progress))
    weights = CheckpointWeights(files, adapter, config, hf)
    tokenizer = directory / "tokenizer.json"
    return Checkpoint(
        path=directory,
        architecture=arch,
        config=config,
        weights=weights,
        tokenizer_path=tokenizer if tokenizer.is_file() else None,
        eos_token_ids=stop_ids(directory, hf),
    )


def weights_name(
    directory: Path,
    architecture: str,
    dtype: torch.dtype,
    model_id: str | None,
    progress: Callable[[str], None] | None = None,
) -> str:
    """The identity of the checkpoint's weights as this runtime computes with them: the
    content digest of the directory (or the user's ``model_id``), the architecture, the
    dtype and ``NUMERICS_VERSION``. Explicit ids start with ``user-``, digests with
    ``weights-v``: the two never collide."""
    if model_id is not None:
        if not model_id.strip():
            raise ValueError(f"--model-id must not be empty, got {model_id!r}")
        return f"user-{model_id}-{architecture}-n{NUMERICS_VERSION}"
    extra = {
        "architecture": architecture,
        "dtype": str(dtype).removeprefix("torch."),
        "runtime_numerics": str(NUMERICS_VERSION),
    }
    return checkpoint_model_id(directory, extra=extra, progress=progress)


def _ids(value: object) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(dict.fromkeys(value))
    return ()


def stop_ids(directory: Path, hf: dict | None = None) -> tuple[int, ...]:
    """The end-of-sequence ids as transformers' ``generate`` takes them: the
    ``eos_token_id`` of ``generation_config.json`` (an int or a list), else of
    ``config.json``, else the tokenizer's ``eos_token`` (``tokenizer_config.json``, looked up
    in ``tokenizer.json``). Empty when none names one."""
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if name == "config.json" and hf is not None:
            found = _ids(hf.get("eos_token_id"))
        elif path.is_file():
            found = _ids(json.loads(path.read_text()).get("eos_token_id"))
        else:
            found = ()
        if found:
            return found
    return _tokenizer_eos(directory)


def _tokenizer_eos(directory: Path) -> tuple[int, ...]:
    config, tokenizer = directory / "tokenizer_config.json", directory / "tokenizer.json"
    if not config.is_file() or not tokenizer.is_file():
        return ()
    eos = json.loads(config.read_text()).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str):
        return ()
    data = json.loads(tokenizer.read_text())
    for token in data.get("added_tokens") or []:
        if token.get("content") == eos and isinstance(token.get("id"), int):
            return (token["id"],)
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(eos), int):
        return (vocab[eos],)
    return ()


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """What a ``--model`` flag names: a preset (seeded weights) or a checkpoint."""

    config: ModelConfig
    weights: WeightSource | None
    """None: the preset's seeded weights."""
    checkpoint: Checkpoint | None


def choose_model(
    model: str,
    dtype: torch.dtype,
    seed: int = 0,
    *,
    model_id: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> ModelChoice:
    """``model`` is a preset name (``tiny``, ``small``) or a checkpoint directory.

    ``model_id``: an explicit identity of a checkpoint's weights (``load_checkpoint``);
    a preset has its own (its weights are a function of the seed), so ``ValueError``."""
    if model in PRESETS:
        if model_id is not None:
            raise ValueError(
                f"--model-id is for checkpoint directories; the preset {model!r} is "
                "identified by its config and --seed"
            )
        return ModelChoice(preset(model, dtype=dtype, seed=seed), None, None)
    if not Path(model).is_dir():
        raise ValueError(
            f"--model {model!r} is neither a preset {sorted(PRESETS)} nor a checkpoint directory"
        )
    ckpt = load_checkpoint(model, dtype, model_id=model_id, progress=progress)
    return ModelChoice(ckpt.config, ckpt.weights, ckpt)
