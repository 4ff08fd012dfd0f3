"""The model's blocks, written for one device; ``shard_tp`` cuts each for a tp rank.

Every block holds its full weights after construction (generated from the seed), so the
one-device model is the reference. ``shard_tp(rank, size)`` keeps the rank's heads /
columns / rows (gpt-fast style): forward code is the same for every mesh and reduces
over tp with ``tp.all_reduce``, the identity on one rank.

Dims: ``T`` tokens of this rank's chunk, ``D`` d_model, ``H``/``G`` local query/KV heads,
``E`` attention head dim, ``S`` SSM heads (local), ``P`` SSM head dim, ``N`` state size,
``K`` conv kernel, ``F`` MLP hidden (local).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.model.config import ModelConfig
from runtime.model.parallel import AxisComm, kv_shard_owner, kv_shard_positions
from runtime.model.ssm import (
    advance_window,
    causal_conv,
    chunked_scan,
    combine_chunk_states,
    prefix_correction,
)
from runtime.model.state import SeqState

# -- deterministic weights ----------------------------------------------------------------------


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


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, computed in float32, returned in ``x.dtype``."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype)


def rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary embedding (rotate-half) of ``x`` ``[T, heads, E]`` at absolute ``positions`` [T]."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def _cols(w: Tensor, start: int, stop: int) -> Tensor:
    return w[:, start:stop].contiguous()


def _rows(w: Tensor, start: int, stop: int) -> Tensor:
    return w[start:stop].contiguous()


class RMSNorm:
    def __init__(self, config: ModelConfig, name: str) -> None:
        self.weight = 1.0 + normal(config.seed, name, (config.d_model,), 0.1)
        self.eps = config.norm_eps

    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        self.weight = self.weight.to(device=device, dtype=dtype)

    def __call__(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


# -- attention ----------------------------------------------------------------------------------


class PartialAttention:
    """Softmax attention over some keys: ``out`` ``[T, H, E]`` float32 and ``lse`` ``[T, H]``."""

    __slots__ = ("out", "lse")

    def __init__(self, out: Tensor, lse: Tensor) -> None:
        self.out = out
        self.lse = lse


def attend(q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor, k_pos: Tensor) -> PartialAttention:
    """Causal GQA attention of ``q`` ``[T, H, E]`` over ``k``/``v`` ``[L, G, E]`` (float32).

    A key is visible iff its position is <= the query's. With no visible key a row has
    ``lse = -inf`` and ``out = 0`` (so that log-sum-exp merging ignores it).
    """
    rep = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("the,lhe->htl", q.float(), kf) / math.sqrt(q.shape[-1])
    hidden = k_pos[None, None, :] > q_pos[None, :, None]
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, T]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("htl,lhe->the", probs, vf)
    return PartialAttention(out, lse.T.contiguous())


def merge_partials(outs: Tensor, lses: Tensor) -> Tensor:
    """Merge partial attentions ``outs`` ``[R, T, H, E]`` with ``lses`` ``[R, T, H]``."""
    top = lses.max(dim=0).values
    weights = torch.exp(lses - top[None])  # [R, T, H]; 0 for empty partials
    return (weights[..., None] * outs).sum(0) / weights.sum(0)[..., None]


class Attention:
    """GQA with RoPE. Weights ``wq`` ``[D, H*E]``, ``wk``/``wv`` ``[D, G*E]``, ``wo`` ``[H*E, D]``.

    ``cp_kv`` and ``page_size`` say which tokens' K/V this cp rank keeps (see SeqState).
    """

    def __init__(self, config: ModelConfig, layer_id: int, cp_kv: str, page_size: int) -> None:
        c, name = config, f"layers.{layer_id}.attn"
        d, e = c.d_model, c.head_dim
        self.layer_id = layer_id
        self.head_dim = e
        self.theta = c.rope_theta
        self.cp_kv = cp_kv
        self.page_size = page_size
        self.num_heads = c.num_heads
        self.num_kv_heads = c.num_kv_heads
        self.wq = normal(c.seed, f"{name}.wq", (d, c.num_heads * e), d**-0.5)
        self.wk = normal(c.seed, f"{name}.wk", (d, c.num_kv_heads * e), d**-0.5)
        self.wv = normal(c.seed, f"{name}.wv", (d, c.num_kv_heads * e), d**-0.5)
        self.wo = normal(c.seed, f"{name}.wo", (c.num_heads * e, d), (c.num_heads * e) ** -0.5)

    def shard_tp(self, rank: int, size: int) -> None:
        """Keep query heads ``[rank*H/tp, (rank+1)*H/tp)`` and the KV heads they read.

        With fewer KV heads than tp, each rank keeps the one KV head of its query group.
        """
        e, heads = self.head_dim, self.num_heads // size
        q0 = rank * heads
        if self.num_kv_heads >= size:
            kv_heads = self.num_kv_heads // size
            k0 = rank * kv_heads
        else:
            kv_heads = 1
            k0 = q0 // (self.num_heads // self.num_kv_heads)
        self.wq = _cols(self.wq, q0 * e, (q0 + heads) * e)
        self.wk = _cols(self.wk, k0 * e, (k0 + kv_heads) * e)
        self.wv = _cols(self.wv, k0 * e, (k0 + kv_heads) * e)
        self.wo = _rows(self.wo, q0 * e, (q0 + heads) * e)
        self.num_heads, self.num_kv_heads = heads, kv_heads

    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        for name in ("wq", "wk", "wv", "wo"):
            setattr(self, name, getattr(self, name).to(device=device, dtype=dtype))

    def _qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        t, e = x.shape[0], self.head_dim
        q = rope((x @ self.wq).view(t, self.num_heads, e), positions, self.theta)
        k = rope((x @ self.wk).view(t, self.num_kv_heads, e), positions, self.theta)
        v = (x @ self.wv).view(t, self.num_kv_heads, e)
        return q, k, v

    def _project(self, out: Tensor, dtype: torch.dtype, tp: AxisComm) -> Tensor:
        return tp.all_reduce(out.flatten(1).to(dtype) @ self.wo)

    def prefill(
        self, x: Tensor, bounds: list[tuple[int, int]], state: SeqState, cp: AxisComm, tp: AxisComm
    ) -> Tensor:
        """Attend this rank's chunk ``x`` ``[T, D]`` (bounds[cp.rank] of the new tokens).

        All-gathers the new K/V over cp; under ``shard`` also the cached prefix's shards.
        Appends to ``state.k/v[layer_id]`` the tokens this rank keeps.
        """
        lid, prefix_len = self.layer_id, state.num_tokens
        start, end = bounds[cp.rank]
        positions = torch.arange(prefix_len + start, prefix_len + end, device=x.device)
        q, k, v = self._qkv(x, positions)
        lengths = [e - s for s, e in bounds]
        k_new = torch.cat(cp.all_gather_ragged(k, lengths))
        v_new = torch.cat(cp.all_gather_ragged(v, lengths))
        k_old, v_old = state.k[lid], state.v[lid]
        if self.cp_kv == "shard":
            k_old = self._unshard(k_old, prefix_len, cp)
            v_old = self._unshard(v_old, prefix_len, cp)
        k_all, v_all = torch.cat([k_old, k_new]), torch.cat([v_old, v_new])
        k_pos = torch.arange(k_all.shape[0], device=x.device)
        out = attend(q, positions, k_all, v_all, k_pos).out
        if self.cp_kv == "shard":
            new_pos = torch.arange(prefix_len, prefix_len + k_new.shape[0], device=x.device)
            mine = kv_shard_owner(new_pos, self.page_size, cp.size) == cp.rank
            state.k[lid] = torch.cat([state.k[lid], k_new[mine]])
            state.v[lid] = torch.cat([state.v[lid], v_new[mine]])
        else:
            state.k[lid], state.v[lid] = k_all, v_all
        return self._project(out, x.dtype, tp)

    def _unshard(self, local: Tensor, num_tokens: int, cp: AxisComm) -> Tensor:
        # Rebuild the prefix's K or V in position order from every cp rank's shard.
        owned = [kv_shard_positions(num_tokens, self.page_size, cp.size, r) for r in range(cp.size)]
        parts = cp.all_gather_ragged(local, [len(p) for p in owned])
        full = local.new_empty((num_tokens, *local.shape[1:]))
        for positions, part in zip(owned, parts, strict=True):
            full[positions.to(full.device)] = part
        return full

    def decode(self, x: Tensor, state: SeqState, cp: AxisComm, tp: AxisComm) -> Tensor:
        """One token ``x`` ``[1, D]`` at position ``state.num_tokens``, the same on every cp rank.

        ``replicate``: every rank appends and attends over all keys. ``shard``: only the
        owner appends; each rank attends over its keys and the partials are merged over cp
        by log-sum-exp.
        """
        lid, pos = self.layer_id, state.num_tokens
        positions = torch.tensor([pos], device=x.device)
        q, k, v = self._qkv(x, positions)
        if self.cp_kv == "shard":
            if int(kv_shard_owner(positions, self.page_size, cp.size)) == cp.rank:
                state.k[lid] = torch.cat([state.k[lid], k])
                state.v[lid] = torch.cat([state.v[lid], v])
            k_pos = kv_shard_positions(pos + 1, self.page_size, cp.size, cp.rank).to(x.device)
            part = attend(q, positions, state.k[lid], state.v[lid], k_pos)
            out = merge_partials(cp.all_gather(part.out), cp.all_gather(part.lse))
        else:
            state.k[lid] = torch.cat([state.k[lid], k])
            state.v[lid] = torch.cat([state.v[lid], v])
            k_pos = torch.arange(pos + 1, device=x.device)
            out = attend(q, positions, state.k[lid], state.v[lid], k_pos).out
        return self._project(out, x.dtype, tp)


# -- SSM ----------------------------------------------------------------------------------------


class Mamba2:
    """Mamba-2 style mixer with per-head B and C.

    Weights: ``w_z`` ``[D, S*P]``, ``w_xbc`` ``[D, S*(P+2N)]`` (head-major conv channels),
    ``w_dt`` ``[D, S]``, ``conv_w`` ``[S*(P+2N), K]``, ``conv_b``, ``dt_bias``/``a_log``/``d_skip``
    ``[S]`` (float32), ``norm_w`` ``[S*P]`` (per-head RMSNorm of the gated output, which
    keeps tp exact), ``w_out`` ``[S*P, D]``.
    """

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        c, name = config, f"layers.{layer_id}.ssm"
        d, s, p, n = c.d_model, c.ssm_heads, c.ssm_head_dim, c.ssm_state_dim
        self.layer_id = layer_id
        self.heads, self.head_dim, self.state_dim = s, p, n
        self.chunk, self.eps = c.scan_chunk, c.norm_eps
        self.w_z = normal(c.seed, f"{name}.w_z", (d, s * p), d**-0.5)
        self.w_xbc = normal(c.seed, f"{name}.w_xbc", (d, c.conv_dim), d**-0.5)
        self.w_dt = normal(c.seed, f"{name}.w_dt", (d, s), 0.1 * d**-0.5)
        self.conv_w = normal(c.seed, f"{name}.conv_w", (c.conv_dim, c.conv_kernel), 0.5)
        self.conv_b = normal(c.seed, f"{name}.conv_b", (c.conv_dim,), 0.1)
        # dt = softplus(dt_raw + dt_bias) starts log-uniform in [1e-3, 1e-1], as in Mamba.
        dt0 = torch.exp(uniform(c.seed, f"{name}.dt0", (s,), math.log(1e-3), math.log(1e-1)))
        self.dt_bias = dt0 + torch.log(-torch.expm1(-dt0))
        self.a_log = torch.log(uniform(c.seed, f"{name}.a", (s,), 1.0, 16.0))
        self.d_skip = uniform(c.seed, f"{name}.d_skip", (s,), 0.5, 1.5)
        self.norm_w = 1.0 + normal(c.seed, f"{name}.norm_w", (s * p,), 0.1)
        self.w_out = normal(c.seed, f"{name}.w_out", (s * p, d), (s * p) ** -0.5)

    def shard_tp(self, rank: int, size: int) -> None:
        """Keep heads ``[rank*S/tp, (rank+1)*S/tp)``: a contiguous block of every projection."""
        s = self.heads // size
        h0, h1 = rank * s, (rank + 1) * s
        p, width = self.head_dim, self.head_dim + 2 * self.state_dim
        self.w_z = _cols(self.w_z, h0 * p, h1 * p)
        self.w_xbc = _cols(self.w_xbc, h0 * width, h1 * width)
        self.w_dt = _cols(self.w_dt, h0, h1)
        self.conv_w = _rows(self.conv_w, h0 * width, h1 * width)
        self.conv_b = _rows(self.conv_b, h0 * width, h1 * width)
        self.dt_bias, self.a_log, self.d_skip = (
            _rows(t, h0, h1) for t in (self.dt_bias, self.a_log, self.d_skip)
        )
        self.norm_w = _rows(self.norm_w, h0 * p, h1 * p)
        self.w_out = _rows(self.w_out, h0 * p, h1 * p)
        self.heads = s

    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        for name in ("w_z", "w_xbc", "w_dt", "conv_w", "conv_b", "norm_w", "w_out"):
            setattr(self, name, getattr(self, name).to(device=device, dtype=dtype))
        # The decay parameters stay float32: the scan runs in float32 for any model dtype.
        for name in ("dt_bias", "a_log", "d_skip"):
            setattr(self, name, getattr(self, name).to(device=device))

    def forward(
        self, x: Tensor, bounds: list[tuple[int, int]], state: SeqState, cp: AxisComm, tp: AxisComm
    ) -> Tensor:
        """Run this rank's chunk ``x`` ``[T, D]`` (bounds[cp.rank] of the new tokens).

        Conv: the window entering the chunk comes from the carried conv state and the
        gathered tails (last K-1 inputs) of the chunks before it. Scan: from zero, then the
        exact correction from the state entering the chunk, chained over the gathered
        (total log decay, final state) of every chunk. ``state.conv/ssm[layer_id]`` become
        the states after the last new token (the same on every cp rank).
        Decode calls this with one token and a one-rank ``cp``.
        """
        lid, t = self.layer_id, x.shape[0]
        s, p, n = self.heads, self.head_dim, self.state_dim
        xbc = x @ self.w_xbc
        window = state.conv[lid].T.to(x.dtype)  # [K-1, C]
        k1 = window.shape[0]
        tails = cp.all_gather_ragged(xbc[max(t - k1, 0) :], [min(e - b, k1) for b, e in bounds])
        for tail in tails[: cp.rank]:
            window = advance_window(window, tail)
        after = window
        for tail in tails[cp.rank :]:
            after = advance_window(after, tail)
        conv = causal_conv(xbc, window, self.conv_w, self.conv_b).float().view(t, s, p + 2 * n)
        xs, B, C = conv.split([p, n, n], dim=-1)
        dt = F.softplus((x @ self.w_dt).float() + self.dt_bias)  # [T, S]
        A = -torch.exp(self.a_log)
        local = chunked_scan(xs, dt, A, B, C, xs.new_zeros(s, p, n), self.chunk)
        decays = cp.all_gather((dt * A).sum(0))
        chained = combine_chunk_states(decays, cp.all_gather(local.final_state), state.ssm[lid])
        y = local.y + prefix_correction(dt, A, C, chained.initial[cp.rank])
        y = y + self.d_skip[:, None] * xs
        z = (x @ self.w_z).float().view(t, s, p)
        y = rms_norm(y * F.silu(z), self.norm_w.float().view(s, p), self.eps)
        state.conv[lid] = after.T.contiguous()
        state.ssm[lid] = chained.final_state
        return tp.all_reduce(y.reshape(t, s * p).to(x.dtype) @ self.w_out)


# -- MLP ----------------------------------------------------------------------------------------


class MLP:
    """SwiGLU (``w1``, ``w3`` ``[D, F]``, ``w2`` ``[F, D]``) or GELU (``w1``, ``w2``)."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        c, name = config, f"layers.{layer_id}.mlp"
        d, f = c.d_model, c.mlp_hidden
        self.kind = c.mlp_kind
        self.w1 = normal(c.seed, f"{name}.w1", (d, f), d**-0.5)
        self.w3 = normal(c.seed, f"{name}.w3", (d, f), d**-0.5) if self.kind == "swiglu" else None
        self.w2 = normal(c.seed, f"{name}.w2", (f, d), f**-0.5)

    def shard_tp(self, rank: int, size: int) -> None:
        """Keep hidden columns ``[rank*F/tp, (rank+1)*F/tp)`` (rows of ``w2``)."""
        f = self.w1.shape[1] // size
        self.w1 = _cols(self.w1, rank * f, (rank + 1) * f)
        if self.w3 is not None:
            self.w3 = _cols(self.w3, rank * f, (rank + 1) * f)
        self.w2 = _rows(self.w2, rank * f, (rank + 1) * f)

    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        self.w1 = self.w1.to(device=device, dtype=dtype)
        self.w2 = self.w2.to(device=device, dtype=dtype)
        if self.w3 is not None:
            self.w3 = self.w3.to(device=device, dtype=dtype)

    def __call__(self, x: Tensor, tp: AxisComm) -> Tensor:
        if self.w3 is not None:
            hidden = F.silu(x @ self.w1) * (x @ self.w3)
        else:
            hidden = F.gelu(x @ self.w1)
        return tp.all_reduce(hidden @ self.w2)
