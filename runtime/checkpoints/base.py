"""The adapter interface and the safetensors reader that serves the model's weights.

An :class:`Adapter` knows one Hugging Face architecture: it turns ``config.json`` into a
:class:`~runtime.model.ModelConfig` and says, for every logical tensor the model asks
for (``runtime.model.weights``), which checkpoint tensor holds it (:class:`TensorRef`:
a name, a row offset into a packed tensor, an expert index, a squeezed dim). The
:class:`CheckpointWeights` source then reads exactly the requested rows / columns with
``safe_open(...).get_slice``: a rank never materialises a tensor it does not keep.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from runtime.model.config import ModelConfig
from runtime.model.weights import Ranges


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Where a logical tensor lives: ``tensor[expert][row0 : row0 + rows]`` (then
    ``squeeze`` removes a size-1 dim 1, e.g. of a conv weight ``[C, 1, K]``)."""

    name: str
    row0: int = 0
    rows: int | None = None
    """Logical rows (None: all rows from ``row0``)."""
    expert: int | None = None
    squeeze: bool = False
    step: int = 1
    """Logical row ``i`` is stored row ``row0 + i * step`` (interleaved packing, e.g.
    gpt-oss's ``gate_up_proj``: gate at even, up at odd columns)."""
    transposed: bool = False
    """Stored as ``[in, out]`` (``x @ W``): logical rows are the stored last dim."""
    scale: float = 1.0
    """Multiplies the tensor as read (in float32, then back to the stored dtype): a
    constant multiplier the checkpoint's model applies around a projection (Falcon-H1's
    muP multipliers) folded into its weight."""


class Adapter(Protocol):
    """One architecture's mapping. Stateless; module-level instances."""

    architecture: str
    """The ``architectures[0]`` of ``config.json`` this adapter reads."""

    def model_config(self, hf: Mapping[str, Any], dtype: torch.dtype, name: str) -> ModelConfig:
        """The model config of ``hf`` (a parsed ``config.json``). ``ValueError`` for a
        feature the runtime does not support, naming it."""
        ...

    def tensor(self, name: str, config: ModelConfig, hf: Mapping[str, Any]) -> TensorRef:
        """The checkpoint tensor behind logical tensor ``name``."""
        ...


def hf_value(hf: Mapping[str, Any], key: str, default: Any) -> Any:
    """``hf[key]`` with the class default for keys ``save_pretrained`` left out (it
    writes only values that differ from the defaults); ``{"__float__": "Infinity"}``
    and None map back to floats / the default."""
    value = hf.get(key, default)
    if value is None:
        return default
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    if isinstance(value, list):
        return [hf_value({"v": v}, "v", v) for v in value]
    return value


def unsupported(architecture: str, what: str) -> ValueError:
    return ValueError(f"{architecture}: {what} is not supported by this runtime")


def parse_dtype(hf: Mapping[str, Any]) -> torch.dtype:
    """The checkpoint's dtype (``dtype`` / ``torch_dtype``; float32 when absent)."""
    text = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float32}
    if text not in table:
        raise ValueError(f"checkpoint dtype {text!r}; supported: {sorted(table)}")
    return table[text]


class SafetensorsFiles:
    """The ``*.safetensors`` files of a checkpoint directory and which holds which tensor."""

    def __init__(self, directory: Path) -> None:
        try:
            from safetensors import safe_open
        except ImportError as err:  # pragma: no cover - the hf extra installs it
            raise ValueError("checkpoints need safetensors: pip install -e '.[hf]'") from err

        index = directory / "model.safetensors.index.json"
        files: dict[str, Path] = {}
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: directory / f for name, f in weight_map.items()}
        else:
            for path in sorted(directory.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as f:
                    files.update({name: path for name in f.keys()})
        if not files:
            raise ValueError(f"no *.safetensors weights in {directory}")
        self.files = files
        self._open: dict[Path, Any] = {}
        self._safe_open = safe_open

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def slice(self, name: str) -> Any:
        """The lazy ``get_slice`` handle of tensor ``name`` (``KeyError`` if absent)."""
        path = self.files[name]
        if path not in self._open:
            self._open[path] = self._safe_open(str(path), framework="pt")
        return self._open[path].get_slice(name)


class CheckpointWeights:
    """A :class:`~runtime.model.weights.WeightSource` reading a checkpoint's slices."""

    def __init__(
        self, files: SafetensorsFiles, adapter: Adapter, config: ModelConfig, hf: Mapping
    ) -> None:
        self.files = files
        self.adapter = adapter
        self.config = config
        self.hf = hf
        self.bytes_read = 0
        """Bytes of tensor data read so far (what this rank holds, plus nothing else)."""

    def get(self, name: str, rows: Ranges | None = None, cols: Ranges | None = None) -> Tensor:
        ref = self.adapter.tensor(name, self.config, self.hf)
        handle = self.files.slice(ref.name)
        shape = handle.get_shape()
        lead: tuple[Any, ...] = () if ref.expert is None else (slice(ref.expert, ref.expert + 1),)
        row_dim = len(shape) - 1 if ref.transposed else len(lead)
        step = ref.step
        total = ref.rows if ref.rows is not None else -(-(shape[row_dim] - ref.row0) // step)
        row_ranges = rows if rows is not None else ((0, total),)
        parts = []
        for a, b in row_ranges:
            assert 0 <= a <= b <= total, (name, a, b, total)
            stored = slice(ref.row0 + a * step, ref.row0 + max(b - 1, a) * step + (b > a))
            block = self._read(handle, lead, stored, cols, ref.transposed)
            if step > 1:
                block = block[(slice(None),) * row_dim + (slice(None, None, step),)]
            if ref.expert is not None:
                block = block[0]
            if ref.transposed:
                block = block.transpose(-1, -2)
            if ref.squeeze:
                block = block[:, 0]
            parts.append(block.contiguous())
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        if ref.scale != 1.0:
            out = (out.float() * ref.scale).to(out.dtype)
        self.bytes_read += out.numel() * out.element_size()
        return out

    @staticmethod
    def _read(
        handle: Any, lead: tuple[Any, ...], stored: slice, cols: Ranges | None, transposed: bool
    ) -> Tensor:
        # The stored block of logical rows ``stored`` (and logical columns ``cols``).
        if transposed:
            if cols is None:
                return handle[(*lead, slice(None), stored)]
            return torch.cat([handle[(*lead, slice(c0, c1), stored)] for c0, c1 in cols], dim=-2)
        index = (*lead, stored)
        if cols is None:
            return handle[index]
        return torch.cat([handle[(*index, slice(c0, c1))] for c0, c1 in cols], dim=-1)
