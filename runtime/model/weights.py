"""Where the model's weights come from: seeded random tensors or a checkpoint.

The model asks a :class:`WeightSource` for *logical* tensors by name, restricted to the
rows / columns its rank keeps (the tp shard), so a checkpoint reader can read just
those slices. Logical tensors are in the ``[out_features, in_features]`` orientation of
``torch.nn.functional.linear``; vectors are 1-D. Names (``b`` = block index in
``ModelConfig.blocks``, ``e`` = expert):

=============================  ==============  ===========================================
name                           shape           what
=============================  ==============  ===========================================
``embed``                      ``[V, D]``      token embeddings
``lm_head``                    ``[V, D]``      output projection (``embed`` when tied)
``final_norm``                 ``[D]``         last RMSNorm
``blocks.b.norm``              ``[D]``         the block's pre-norm
``blocks.b.{q,k,v}``           ``[H*E, D]``    attention projections (k, v: ``[G*E, D]``)
``blocks.b.o``                 ``[D, H*E]``
``blocks.b.{z,x}``             ``[S*P, D]``    SSM gate and input
``blocks.b.{B,C}``             ``[Gs*N, D]``   SSM input/output matrices, per group
``blocks.b.dt``                ``[S, D]``      SSM step
``blocks.b.conv_{x,B,C}``      ``[.., K]``     depthwise conv weights of x, B, C
``blocks.b.conv_bias_{x,B,C}`` ``[..]``        conv biases
``blocks.b.{dt_bias,A_log,D}`` ``[S]``         SSM per-head parameters
``blocks.b.ssm_norm``          ``[S*P]``       gated RMSNorm weight
``blocks.b.out``               ``[D, S*P]``
``blocks.b.{gate,up}``         ``[F, D]``      MLP (``gate`` for swiglu only)
``blocks.b.down``              ``[D, F]``
``blocks.b.router``            ``[X, D]``      MoE router (``router_bias`` ``[X]``: sigmoid,
                                               or ``router_has_bias``)
``blocks.b.experts.e.*``       as the MLP      routed expert ``e``
``blocks.b.shared.*``          as the MLP      shared expert
=============================  ==============  ===========================================

MLA blocks (``runtime.model.mla``): ``q_a`` ``[Lq, D]``, ``q_a_norm`` ``[Lq]``, ``q_b``
``[H*(N+R), Lq]``, ``kv_a`` ``[Lkv+R, D]``, ``kv_a_norm`` ``[Lkv]``, ``kv_b``
``[H*(N+V), Lkv]``, ``o`` ``[D, H*V]`` and the lightning indexer's ``index_q``
``[Hi*Di, Lq]``, ``index_k`` ``[Di, D]``, ``index_norm`` / ``index_norm_bias`` ``[Di]``,
``index_w`` ``[Hi, D]``.

Parallel blocks (``P``, Falcon-H1) hold both mixers' tensors under ``blocks.b.attn.*``
(``q``, ``k``, ``v``, ``o``) and ``blocks.b.ssm.*`` (the SSM names above).

Windowed attention blocks (``runtime.model.windowed``) add, by config: ``{q,k,v,o}_bias``
(``[H*E]``, ``[G*E]``, ``[D]``), ``sinks`` ``[H]``, ``q_norm`` / ``k_norm`` ``[E]``. With
``sandwich_norm`` every block has ``post_norm`` ``[D]``; ``swiglu_clamp`` MLPs have
``gate_bias`` / ``up_bias`` ``[F]`` and ``down_bias`` ``[D]``.
"""

from __future__ import annotations

import math
import zlib
from typing import Protocol

import torch
from torch import Tensor

from runtime.model.config import ATTENTION, MIXERS, MLP, MOE, PARALLEL, SSM, ModelConfig

Ranges = tuple[tuple[int, int], ...]
"""Half-open index ranges along one dim, concatenated in order."""


class WeightSource(Protocol):
    """Hands out logical tensors (see the module docstring), sliced as asked."""

    def get(self, name: str, rows: Ranges | None = None, cols: Ranges | None = None) -> Tensor:
        """Tensor ``name`` restricted to ``rows`` (dim 0) and ``cols`` (dim 1); None = all.

        Returns a new CPU tensor (the checkpoint's dtype, or float32 when seeded).
        ``KeyError`` names a tensor the source does not have.
        """
        ...


def take(tensor: Tensor, rows: Ranges | None, cols: Ranges | None) -> Tensor:
    """``tensor`` restricted to ``rows`` and ``cols`` (a copy)."""
    if rows is not None:
        tensor = torch.cat([tensor[a:b] for a, b in rows])
    if cols is not None:
        tensor = torch.cat([tensor[:, a:b] for a, b in cols], dim=1)
    return tensor.clone()


# -- seeded random weights -------------------------------------------------------------------


def _generator(seed: int, name: str) -> torch.Generator:
    # One generator per tensor: a tensor's values do not depend on which others exist.
    gen = torch.Generator()
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return gen


def normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> Tensor:
    """float32 N(0, std^2) values that depend only on (seed, name, shape)."""
    return torch.randn(shape, generator=_generator(seed, name)) * std


def uniform(seed: int, name: str, shape: tuple[int, ...], low: float, high: float) -> Tensor:
    """float32 U(low, high) values that depend only on (seed, name, shape)."""
    return torch.rand(shape, generator=_generator(seed, name)) * (high - low) + low


class SeededWeights:
    """Random weights that are a pure function of ``config.seed`` and the tensor name.

    Every rank generates the full logical tensor and keeps its slice, so every mesh
    runs the same model. The legacy names below (``layers.i.*``) keep the presets'
    weights what they always were.
    """

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self._layer_of_block: dict[int, int] = {}
        for layer, blocks in enumerate(config.layer_blocks()):
            for b in blocks:
                self._layer_of_block[b] = layer

    def get(self, name: str, rows: Ranges | None = None, cols: Ranges | None = None) -> Tensor:
        return take(self._full(name), rows, cols)

    def _full(self, name: str) -> Tensor:
        c = self.config
        d, seed = c.d_model, c.seed
        if name == "embed":
            return normal(seed, "embed", (c.vocab_size, d), 1.0)
        if name == "lm_head":
            if c.tie_embeddings:
                return self._full("embed")
            return normal(seed, "lm_head", (d, c.vocab_size), d**-0.5).T
        if name == "final_norm":
            return 1.0 + normal(seed, "final_norm", (d,), 0.1)
        _, b_text, param = name.split(".", 2)
        b = int(b_text)
        kind = c.blocks[b]
        layer = self._layer_of_block[b]
        if param == "norm":
            first_mixer = kind in MIXERS
            legacy = f"layers.{layer}.norm1" if first_mixer else f"layers.{layer}.norm2"
            if c.block_pattern:  # non-default patterns: one name per block
                legacy = f"blocks.{b}.norm"
            return 1.0 + normal(seed, legacy, (d,), 0.1)
        if kind == ATTENTION:
            return self._attention(layer, param)
        if kind == SSM:
            return self._ssm(layer, param)
        if kind == PARALLEL:  # "attn.{param}" / "ssm.{param}": the two mixers' tensors
            part, rest = param.split(".", 1)
            return self._attention(layer, rest) if part == "attn" else self._ssm(layer, rest)
        prefix = f"layers.{layer}.mlp" if not c.block_pattern else f"blocks.{b}"
        if kind == MLP:
            return self._mlp(prefix, param, c.mlp_hidden)
        assert kind == MOE
        if param == "router":
            return normal(seed, f"{prefix}.router", (c.num_experts, d), d**-0.5)
        if param == "router_bias":
            return uniform(seed, f"{prefix}.router_bias", (c.num_experts,), -0.1, 0.1)
        group, rest = param.split(".", 1)
        if group == "shared":
            return self._mlp(f"{prefix}.shared", rest, c.shared_expert_hidden)
        e, rest = rest.split(".", 1)
        return self._mlp(f"{prefix}.experts.{e}", rest, c.expert_hidden)

    def _attention(self, layer: int, param: str) -> Tensor:
        c = self.config
        d, e, name = c.d_model, c.head_dim, f"layers.{layer}.attn"
        shapes = {
            "q": (c.num_heads * e, d**-0.5),
            "k": (c.num_kv_heads * e, d**-0.5),
            "v": (c.num_kv_heads * e, d**-0.5),
        }
        if param in shapes:
            width, std = shapes[param]
            return normal(c.seed, f"{name}.w{param}", (d, width), std).T
        assert param == "o", param
        hidden = c.num_heads * e
        return normal(c.seed, f"{name}.wo", (hidden, d), hidden**-0.5).T

    def _ssm(self, layer: int, param: str) -> Tensor:
        c = self.config
        d, s, p, n, g = c.d_model, c.ssm_heads, c.ssm_head_dim, c.ssm_state_dim, c.num_groups
        name = f"layers.{layer}.ssm"
        if param == "z":
            return normal(c.seed, f"{name}.w_z", (d, s * p), d**-0.5).T
        if param == "dt":
            return normal(c.seed, f"{name}.w_dt", (d, s), 0.1 * d**-0.5).T
        if param == "out":
            return normal(c.seed, f"{name}.w_out", (s * p, d), (s * p) ** -0.5).T
        if param == "ssm_norm":
            return 1.0 + normal(c.seed, f"{name}.norm_w", (s * p,), 0.1)
        if param in ("x", "B", "C", "conv_x", "conv_B", "conv_C") or param.startswith("conv_bias"):
            # One group-major tensor over the conv channels, cut into x / B / C.
            if param.startswith("conv_bias"):
                full = normal(c.seed, f"{name}.conv_b", (c.conv_dim,), 0.1)[:, None]
                if not c.conv_bias:
                    full = torch.zeros_like(full)
            elif param.startswith("conv"):
                full = normal(c.seed, f"{name}.conv_w", (c.conv_dim, c.conv_kernel), 0.5)
            else:
                full = normal(c.seed, f"{name}.w_xbc", (d, c.conv_dim), d**-0.5).T
            per_group = full.reshape(g, (s // g) * p + 2 * n, -1)
            part = param.rsplit("_", 1)[-1]
            lo, hi = {"x": (0, (s // g) * p), "B": ((s // g) * p, (s // g) * p + n)}.get(
                part, ((s // g) * p + n, (s // g) * p + 2 * n)
            )
            out = per_group[:, lo:hi].reshape(-1, full.shape[1])
            return out[:, 0] if param.startswith("conv_bias") else out
        # dt = softplus(dt_raw + dt_bias) starts log-uniform in [1e-3, 1e-1], as in Mamba.
        if param == "dt_bias":
            dt0 = torch.exp(uniform(c.seed, f"{name}.dt0", (s,), math.log(1e-3), math.log(1e-1)))
            return dt0 + torch.log(-torch.expm1(-dt0))
        if param == "A_log":
            return torch.log(uniform(c.seed, f"{name}.a", (s,), 1.0, 16.0))
        assert param == "D", param
        return uniform(c.seed, f"{name}.d_skip", (s,), 0.5, 1.5)

    def _mlp(self, prefix: str, param: str, hidden: int) -> Tensor:
        c = self.config
        d = c.d_model
        # Legacy names: swiglu w1 = gate, w3 = up; gelu / relu2 w1 = up; w2 = down.
        legacy = {"gate": "w1", "up": "w3" if c.mlp_kind == "swiglu" else "w1", "down": "w2"}
        if param == "down":
            return normal(c.seed, f"{prefix}.w2", (hidden, d), hidden**-0.5).T
        assert param in ("gate", "up"), param
        return normal(c.seed, f"{prefix}.{legacy[param]}", (d, hidden), d**-0.5).T
