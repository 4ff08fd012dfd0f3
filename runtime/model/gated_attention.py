"""Qwen3-Next / Qwen3.5 blocks: gated full attention and the MoE with a gated shared expert.

:class:`GatedAttention` is GQA (same prefill / decode / cp code as
:class:`~runtime.model.layers.Attention`) with a per-head RMSNorm on q and k (before the
partial RoPE) and the output multiplied by ``sigmoid(gate)``, where the gate is a second
half of each query head's projection. :class:`GatedSharedMoE` adds
``sigmoid(x @ w_gate) * shared(x)`` to the routed experts.

Dims as ``layers.py``: ``T`` tokens, ``H``/``G`` local query/KV heads, ``E`` head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.model.config import ModelConfig
from runtime.model.ffn import MoE
from runtime.model.layers import Attention, rms_norm, rope
from runtime.model.parallel import AxisComm
from runtime.model.weights import WeightSource


class GatedAttention(Attention):
    """Weights by logical name: ``q.{h}`` / ``gate.{h}`` ``[E, D]`` per query head, ``k``/``v``
    ``[G*E, D]``, ``o`` ``[D, H*E]``, ``q_norm``/``k_norm`` ``[E]`` (plus ``norm_offset``)."""

    def __init__(
        self,
        config: ModelConfig,
        prefix: str,
        layer_id: int,
        weights: WeightSource,
        tp: AxisComm,
        *,
        cp_kv: str,
        page_size: int,
    ) -> None:
        c, e = config, config.head_dim
        q0, q1, k0, k1 = self._set_heads(c, layer_id, tp, cp_kv, page_size)
        self.eps = c.norm_eps
        wq = torch.cat([weights.get(f"{prefix}.q.{h}") for h in range(q0, q1)])
        wg = torch.cat([weights.get(f"{prefix}.gate.{h}") for h in range(q0, q1)])
        wk = weights.get(f"{prefix}.k", rows=((k0 * e, k1 * e),))
        wv = weights.get(f"{prefix}.v", rows=((k0 * e, k1 * e),))
        self.wqkv = torch.cat([wq, wk, wv, wg]).to(c.dtype)  # one GEMM for q, k, v, gate
        self.wo = weights.get(f"{prefix}.o", cols=((q0 * e, q1 * e),)).to(c.dtype)
        offset = c.norm_offset
        self.q_norm = (weights.get(f"{prefix}.q_norm").float() + offset).to(c.dtype)
        self.k_norm = (weights.get(f"{prefix}.k_norm").float() + offset).to(c.dtype)
        self._gate: Tensor | None = None

    def to(self, device: torch.device) -> None:
        for name in ("wqkv", "wo", "q_norm", "k_norm"):
            setattr(self, name, getattr(self, name).to(device))

    def _qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        t, e = x.shape[0], self.head_dim
        hq, hk = self.num_heads * e, self.num_kv_heads * e
        q, k, v, gate = F.linear(x, self.wqkv).split([hq, hk, hk, hq], dim=-1)
        assert self.q_norm is not None and self.k_norm is not None
        q = rms_norm(q.reshape(t, self.num_heads, e), self.q_norm, self.eps)
        k = rms_norm(k.reshape(t, self.num_kv_heads, e), self.k_norm, self.eps)
        v = v.reshape(t, self.num_kv_heads, e)
        # The gate of this call's queries; _project (same call, same thread) consumes it.
        self._gate = gate
        return (
            rope(q, positions, self.theta, self.rope_dim),
            rope(k, positions, self.theta, self.rope_dim),
            v,
        )

    def _project(self, out: Tensor, dtype: torch.dtype, tp: AxisComm) -> Tensor:
        gate, self._gate = self._gate, None
        assert gate is not None and gate.shape[0] == out.shape[0]
        gated = out.flatten(1).to(dtype) * torch.sigmoid(gate)
        return tp.all_reduce(F.linear(gated, self.wo))


class GatedSharedMoE(MoE):
    """:class:`MoE` whose shared expert is scaled by ``sigmoid(x @ shared_gate^T)``
    (``shared_gate`` ``[1, D]``, replicated over tp)."""

    def __init__(
        self, config: ModelConfig, prefix: str, weights: WeightSource, tp: AxisComm
    ) -> None:
        super().__init__(config, prefix, weights, tp)
        assert self.shared is not None, "a gated shared expert needs shared_expert_hidden"
        self.shared_gate = weights.get(f"{prefix}.shared_gate").to(config.dtype)

    def to(self, device: torch.device) -> None:
        super().to(device)
        self.shared_gate = self.shared_gate.to(device)

    def __call__(self, x: Tensor, tp: AxisComm) -> Tensor:
        out = self.routed(x)
        assert self.shared is not None
        shared = self.shared(x) * torch.sigmoid(F.linear(x, self.shared_gate))
        return tp.all_reduce(out.to(x.dtype) + shared)
