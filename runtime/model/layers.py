"""The model's mixers (attention, Mamba-2), written for one device.

Each block is built from a :class:`~runtime.model.weights.WeightSource` and a tp
coordinate: it asks the source for the rows / columns of its rank only (the shard math
is ``mesh_hicache.layout``'s), so one device is the case ``tp = 1`` and the forward code
is the same for every mesh; it reduces over tp with ``tp.all_reduce`` (the identity on
one rank). Weights are ``[out, in]`` (``F.linear``).

Dims: ``T`` tokens of this rank's chunk, ``D`` d_model, ``H``/``G`` local query/KV heads,
``E`` attention head dim, ``S`` SSM heads (local), ``Gs`` local B/C groups, ``P`` SSM
head dim, ``N`` state size, ``K`` conv kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from mesh_hicache.layout import kv_head_range, ssm_group_range, tp_split
from runtime.model.config import ModelConfig
from runtime.model.parallel import AxisComm, kv_shard_positions
from runtime.model.ssm import (
    advance_window,
    causal_conv,
    chunked_scan,
    combine_chunk_states,
    conv_step,
    prefix_correction,
)
from runtime.model.state import AttentionRows, DecodeSlots, SeqState, decode_slots
from runtime.model.weights import WeightSource


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, computed in float32, returned in ``x.dtype``."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * out.to(x.dtype)


def rope(
    x: Tensor,
    positions: Tensor,
    theta: float,
    dim: int | None = None,
    inv_freq: Tensor | None = None,
    cos_scale: float = 1.0,
) -> Tensor:
    """Rotary embedding (rotate-half) of the first ``dim`` channels (default all) of
    ``x`` ``[T, heads, E]`` at absolute ``positions`` [T]; the other channels pass.
    ``inv_freq`` ``[dim / 2]``: the frequencies (default ``theta ** (-2i / dim)``);
    ``cos_scale`` multiplies cos and sin (YaRN's attention factor)."""
    dim = x.shape[-1] if dim is None else dim
    if dim == 0:
        return x
    half = dim // 2
    freqs = inv_freq if inv_freq is not None else _cached_inv_freq(theta, dim, x.device)
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    cos = (angles.cos() * cos_scale)[:, None, :].to(x.dtype)
    sin = (angles.sin() * cos_scale)[:, None, :].to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:dim], x[..., dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


_INV_FREQ: dict[tuple[float, int, str], Tensor] = {}


def _cached_inv_freq(theta: float, dim: int, device: torch.device) -> Tensor:
    # The same tensor default_inv_freq makes, made once per (theta, dim, device): rope
    # never writes to it.
    key = (theta, dim, str(device))
    freqs = _INV_FREQ.get(key)
    if freqs is None:
        freqs = _INV_FREQ[key] = default_inv_freq(theta, dim).to(device)
    return freqs


def default_inv_freq(theta: float, dim: int) -> Tensor:
    """Plain RoPE frequencies ``theta ** (-2i / dim)`` of ``dim / 2`` pairs (float32)."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


class RMSNorm:
    def __init__(self, weight: Tensor, eps: float) -> None:
        self.weight = weight
        self.eps = eps

    def __call__(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


# -- attention ----------------------------------------------------------------------------------


class PartialAttention:
    """Softmax attention over some keys: ``out`` ``[T, H, E]`` float32 and ``lse`` ``[T, H]``."""

    __slots__ = ("out", "lse")

    def __init__(self, out: Tensor, lse: Tensor) -> None:
        self.out = out
        self.lse = lse


def attend(
    q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor, k_pos: Tensor, scale: float
) -> PartialAttention:
    """Causal GQA attention of ``q`` ``[T, H, E]`` over ``k``/``v`` ``[L, G, E]`` (float32).

    A key is visible iff its position is <= the query's. With no visible key a row has
    ``lse = -inf`` and ``out = 0`` (so that log-sum-exp merging ignores it).
    """
    rep = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("the,lhe->htl", q.float(), kf) * scale
    hidden = k_pos[None, None, :] > q_pos[None, :, None]
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, T]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("htl,lhe->the", probs, vf)
    return PartialAttention(out, lse.T.contiguous())


def attend_causal(q: Tensor, k: Tensor, v: Tensor, offset: int, scale: float) -> Tensor:
    """Attention of ``q`` ``[T, H, E]`` at positions ``offset..offset+T-1`` over keys at
    ``0..L-1`` (float32 ``[T, H, E]``), through the fused SDPA kernel (GQA without
    copying K/V per query head; no mask tensor when the queries are all the keys)."""
    t, length = q.shape[0], k.shape[0]
    if t <= FEW_QUERIES and length > t:
        return _attend_few(q, k, v, offset, scale)
    qf, kf, vf = (x.float().transpose(0, 1) for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if offset == 0 and length == t:
        out = F.scaled_dot_product_attention(
            qf, kf, vf, is_causal=True, scale=scale, enable_gqa=gqa
        )
    else:
        pos = torch.arange(offset, offset + t, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
        out = F.scaled_dot_product_attention(
            qf, kf, vf, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    return out.transpose(0, 1)


FEW_QUERIES = 8
"""Up to this many queries (decode, the last token of a full-prefix hit) over more keys,
attention is two plain matmuls: CPU SDPA with a mask tensor measured 4-15x slower for one
query over 8192 keys (GQA 8/2 x 64)."""


def _attend_few(q: Tensor, k: Tensor, v: Tensor, offset: int, scale: float) -> Tensor:
    # attend_causal for few queries: each KV head's query heads and queries as one matmul
    # row block [G, rep*T, E] (no K/V copy per query head), softmax, matmul.
    t, heads, e = q.shape
    g, length = k.shape[1], k.shape[0]
    rep = heads // g
    qf = q.float().view(t, g, rep, e).permute(1, 2, 0, 3).reshape(g, rep * t, e)
    kf, vf = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [G, L, E]
    scores = torch.matmul(qf, kf.transpose(1, 2)).mul_(scale)  # [G, rep*T, L]
    if offset + t < length or t > 1:  # some key is after some query
        pos = torch.arange(offset, offset + t, device=q.device).repeat(rep)  # [rep*T]
        hidden = torch.arange(length, device=q.device)[None, :] > pos[:, None]
        scores = scores.masked_fill_(hidden[None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [G, rep*T, E]
    return out.view(g, rep, t, e).permute(2, 0, 1, 3).reshape(t, heads, e)


def merge_partials(outs: Tensor, lses: Tensor) -> Tensor:
    """Merge partial attentions ``outs`` ``[R, T, H, E]`` with ``lses`` ``[R, T, H]``."""
    top = lses.max(dim=0).values
    weights = torch.exp(lses - top[None])  # [R, T, H]; 0 for empty partials
    return (weights[..., None] * outs).sum(0) / weights.sum(0)[..., None]


class Attention:
    """GQA with full, partial or no RoPE. ``wqkv`` ``[(H+2G)*E, D]`` (q, k, v fused),
    ``wo`` ``[D, H*E]`` (this rank's heads; with fewer KV heads than tp, the one KV head
    of the rank's query group).

    ``cp_kv`` and ``page_size`` say which tokens' K/V this cp rank keeps (see SeqState).
    """

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
        dtype = c.dtype
        wq = weights.get(f"{prefix}.q", rows=((q0 * e, q1 * e),))
        wk = weights.get(f"{prefix}.k", rows=((k0 * e, k1 * e),))
        wv = weights.get(f"{prefix}.v", rows=((k0 * e, k1 * e),))
        self.wqkv = torch.cat([wq, wk, wv]).to(dtype)  # one GEMM for q, k, v
        self.wo = weights.get(f"{prefix}.o", cols=((q0 * e, q1 * e),)).to(dtype)
        self.bqkv: Tensor | None = None
        if c.attn_bias:
            bq = weights.get(f"{prefix}.q_bias", rows=((q0 * e, q1 * e),))
            bk = weights.get(f"{prefix}.k_bias", rows=((k0 * e, k1 * e),))
            bv = weights.get(f"{prefix}.v_bias", rows=((k0 * e, k1 * e),))
            self.bqkv = torch.cat([bq, bk, bv]).to(dtype)
        self.q_norm: Tensor | None = None
        self.k_norm: Tensor | None = None
        if c.qk_norm:  # (1 + w) norms (Gemma) store w: norm_offset 1
            offset = c.norm_offset
            self.q_norm = (weights.get(f"{prefix}.q_norm").float() + offset).to(dtype)
            self.k_norm = (weights.get(f"{prefix}.k_norm").float() + offset).to(dtype)

    def _set_heads(
        self, config: ModelConfig, layer_id: int, tp: AxisComm, cp_kv: str, page_size: int
    ) -> tuple[int, int, int, int]:
        """Set what every attention kind keeps (layer, head dim, RoPE, scale, cp_kv, page
        size, this rank's head counts); return its query heads ``[q0, q1)`` and KV heads
        ``[k0, k1)``."""
        c, e = config, config.head_dim
        self.layer_id = layer_id
        self.head_dim = e
        self.theta = c.rope_theta
        self.rope_dim = c.rope_dim
        self.scale = c.attn_scale or e**-0.5
        self.eps = c.norm_eps
        self.inv_freq: Tensor | None = None
        self.cos_scale = 1.0
        if c.rope_inv_freq and c.attn_kind != "mla":
            self.inv_freq = torch.tensor(c.rope_inv_freq, dtype=torch.float32)
            self.cos_scale = c.rope_cos_scale
        self.cp_kv = cp_kv
        self.page_size = page_size
        self.rows = AttentionRows(page_size, cp_kv)
        q0, q1 = tp_split(c.num_heads, tp.size, tp.rank)
        k0, k1 = kv_head_range(c.num_heads, c.num_kv_heads, tp.size, tp.rank)
        self.num_heads, self.num_kv_heads = q1 - q0, k1 - k0
        return q0, q1, k0, k1

    def to(self, device: torch.device) -> None:
        for name in ("wqkv", "wo", "bqkv", "q_norm", "k_norm", "inv_freq"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))

    def _qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        t, e = x.shape[0], self.head_dim
        hq, hk = self.num_heads * e, self.num_kv_heads * e
        q, k, v = F.linear(x, self.wqkv, self.bqkv).split([hq, hk, hk], dim=-1)
        q = q.reshape(t, self.num_heads, e)
        k = k.reshape(t, self.num_kv_heads, e)
        v = v.reshape(t, self.num_kv_heads, e)
        if self.q_norm is not None and self.k_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        q = rope(q, positions, self.theta, self.rope_dim, self.inv_freq, self.cos_scale)
        k = rope(k, positions, self.theta, self.rope_dim, self.inv_freq, self.cos_scale)
        return q, k, v

    def _project(self, out: Tensor, dtype: torch.dtype, tp: AxisComm) -> Tensor:
        return tp.all_reduce(F.linear(out.flatten(1).to(dtype), self.wo))

    def prefill(
        self, x: Tensor, bounds: list[tuple[int, int]], state: SeqState, cp: AxisComm, tp: AxisComm
    ) -> Tensor:
        """Attend this rank's chunk ``x`` ``[T, D]`` (bounds[cp.rank] of the new tokens).

        All-gathers the new K/V over cp; under ``shard`` also the cached prefix's shards.
        Stores the new tokens' K/V this rank keeps (``self.rows``: contiguous or paged).
        """
        lid, prefix_len, rows = self.layer_id, state.num_tokens, self.rows
        start, end = bounds[cp.rank]
        positions = torch.arange(prefix_len + start, prefix_len + end, device=x.device)
        q, k, v = self._qkv(x, positions)
        lengths = [e - s for s, e in bounds]
        k_new = torch.cat(cp.all_gather_ragged(k, lengths))
        v_new = torch.cat(cp.all_gather_ragged(v, lengths))
        k_all = rows.extend(state, "k", lid, k_new, prefix_len, cp)
        v_all = rows.extend(state, "v", lid, v_new, prefix_len, cp)
        if q.shape[0]:
            out = attend_causal(q, k_all, v_all, prefix_len + start, self.scale)
        else:
            out = q.float()
        return self._project(out, x.dtype, tp)

    def decode(self, x: Tensor, states: Sequence[SeqState], cp: AxisComm, tp: AxisComm) -> Tensor:
        """One token per state, ``x`` ``[B, D]`` (row i at ``states[i].num_tokens``), the same
        on every cp rank; one GEMM per projection for the batch, attention per sequence.

        ``replicate``: every rank stores and attends over all keys. ``shard``: only the
        owner stores; each rank attends over its keys and the partials of the whole batch
        are merged over cp by log-sum-exp (one gather).
        """
        lid, rows = self.layer_id, self.rows
        positions = torch.tensor([s.num_tokens for s in states], device=x.device)
        q, k, v = self._qkv(x, positions)
        if rows.sharded(cp):
            parts = []
            for i, state in enumerate(states):
                pos = state.num_tokens
                rows.append(state, "k", lid, k[i : i + 1], pos, cp)
                rows.append(state, "v", lid, v[i : i + 1], pos, cp)
                keys = rows.read(state, "k", lid, pos + 1, cp)
                values = rows.read(state, "v", lid, pos + 1, cp)
                k_pos = kv_shard_positions(pos + 1, self.page_size, cp.size, cp.rank)
                part = attend(
                    q[i : i + 1], positions[i : i + 1], keys, values, k_pos.to(x.device), self.scale
                )
                parts.append(torch.cat([part.out, part.lse[..., None]], dim=-1))
            # [cp, B, H, E + 1]: every sequence's (out, lse) in one gather.
            gathered = cp.all_gather(torch.cat(parts))
            out = merge_partials(gathered[..., :-1], gathered[..., -1])
        elif (slots := self._decode_slots(states, x.device)) is not None:
            out = self._decode_paged(q, k, v, states[0], slots)
        else:
            outs = []
            for i, state in enumerate(states):
                pos = state.num_tokens
                keys = rows.extend(state, "k", lid, k[i : i + 1], pos, cp)
                values = rows.extend(state, "v", lid, v[i : i + 1], pos, cp)
                outs.append(attend_causal(q[i : i + 1], keys, values, pos, self.scale))
            out = torch.cat(outs)
        return self._project(out, x.dtype, tp)

    def _decode_slots(self, states: Sequence[SeqState], device: torch.device) -> DecodeSlots | None:
        return decode_slots(states, self.page_size, self.num_kv_heads * self.head_dim, device)

    def _decode_paged(
        self, q: Tensor, k: Tensor, v: Tensor, first: SeqState, slots: DecodeSlots
    ) -> Tensor:
        """Every sequence of a paged batch at once (``decode_slots``): the new K/V rows in
        one write per pool, the keys in one padded gather, one masked attention."""
        assert first.pages is not None
        pools, lid = first.pages.pools, self.layer_id
        k_pool, v_pool = pools.k(lid), pools.v(lid)
        k_pool[slots.write_pages, slots.write_rows] = k.to(k_pool.dtype)
        v_pool[slots.write_pages, slots.write_rows] = v.to(v_pool.dtype)
        keys = k_pool[slots.read_pages, slots.read_rows]  # [B, L, G, E]
        values = v_pool[slots.read_pages, slots.read_rows]
        return attend_padded(q, keys, values, slots.hidden, self.scale)


def attend_padded(q: Tensor, k: Tensor, v: Tensor, hidden: Tensor, scale: float) -> Tensor:
    """One query per sequence, ``q`` ``[B, H, E]``, over its keys ``k``/``v`` ``[B, L, G, E]``
    where ``hidden`` ``[B, L]`` marks the padding (float32 ``[B, H, E]``); the math of
    :func:`_attend_few` for one query, the batch in one matmul pair."""
    b, heads, e = q.shape
    g = k.shape[2]
    qf = q.float().view(b, g, heads // g, e)  # [B, G, rep, E]
    kf = k.float().permute(0, 2, 3, 1)  # [B, G, E, L]
    vf = v.float().transpose(1, 2)  # [B, G, L, E]
    scores = torch.matmul(qf, kf).mul_(scale)  # [B, G, rep, L]
    scores = scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [B, G, rep, E]
    return out.reshape(b, heads, e)


# -- SSM ----------------------------------------------------------------------------------------


class Mamba2:
    """Mamba-2 mixer with B/C shared by groups of heads (``n_groups``).

    This rank keeps heads ``tp_split(S)`` and groups ``ssm_group_range`` (whole groups
    when groups >= tp, else the one group of its heads). Conv channels are group-major:
    per local group ``[x of its local heads, B_g, C_g]``, which is also the order of the
    cached conv state. Weights: ``w_in`` ``[S*P + C + S, D]`` (z, xBC and dt fused; ``w_xbc``
    is a view of its xBC rows), ``conv_w`` ``[C, K]``, ``conv_b`` ``[C]``,
    ``dt_bias``/``a_log``/``d_skip`` ``[S]`` (float32), ``norm_w`` ``[S*P]`` (RMSNorm over
    each whole group of the gated output, or of the output before the gate, or none:
    ``ModelConfig.ssm_norm``; a group split over tp ranks sums its squares over tp),
    ``w_out`` ``[D, S*P]``.
    """

    def __init__(
        self, config: ModelConfig, prefix: str, layer_id: int, weights: WeightSource, tp: AxisComm
    ) -> None:
        c = config
        p, n = c.ssm_head_dim, c.ssm_state_dim
        self.layer_id = layer_id
        self.head_dim, self.state_dim = p, n
        self.chunk, self.eps = c.scan_chunk, c.norm_eps
        self.dt_min, self.dt_max = c.dt_min, c.dt_max
        h0, h1 = tp_split(c.ssm_heads, tp.size, tp.rank)
        g0, g1 = ssm_group_range(c.num_groups, tp.size, tp.rank)
        per_group = c.ssm_heads // c.num_groups
        self.heads, self.groups = h1 - h0, g1 - g0
        self.group0, self.num_groups = g0, c.num_groups
        self.group_channels = per_group * p  # gated-norm width of one whole group
        self.split_group = c.num_groups < tp.size
        # Local conv channels, group-major: (name, row range) pieces in order.
        conv_rows: list[tuple[str, tuple[int, int]]] = []
        for g in range(g0, g1):
            a, b = max(g * per_group, h0), min((g + 1) * per_group, h1)
            conv_rows += [("x", (a * p, b * p)), ("B", (g * n, (g + 1) * n))]
            conv_rows.append(("C", (g * n, (g + 1) * n)))
        dtype = c.dtype

        def pieces(fmt: str) -> Tensor:
            return torch.cat([weights.get(fmt.format(part), rows=(r,)) for part, r in conv_rows])

        w_z = weights.get(f"{prefix}.z", rows=((h0 * p, h1 * p),))
        w_xbc = pieces(prefix + ".{}")
        w_dt = weights.get(f"{prefix}.dt", rows=((h0, h1),))
        # One fused input projection [z | xBC | dt] (one GEMM instead of three).
        self.sizes = (w_z.shape[0], w_xbc.shape[0], w_dt.shape[0])
        self.w_in = torch.cat([w_z, w_xbc, w_dt]).to(dtype)
        self.w_xbc = self.w_in[self.sizes[0] : self.sizes[0] + self.sizes[1]]
        self.conv_w = pieces(prefix + ".conv_{}").to(dtype)
        self.conv_b = pieces(prefix + ".conv_bias_{}").to(dtype)
        heads = ((h0, h1),)
        self.dt_bias = weights.get(f"{prefix}.dt_bias", rows=heads).float()
        self.a_log = weights.get(f"{prefix}.A_log", rows=heads).float()
        self.d_skip = weights.get(f"{prefix}.D", rows=heads).float()
        self.norm = c.ssm_norm
        self.norm_w = torch.ones(0, dtype=dtype)  # ssm_norm="none": no weight
        if self.norm != "none":
            self.norm_w = weights.get(f"{prefix}.ssm_norm", rows=((h0 * p, h1 * p),)).to(dtype)
        self.w_out = weights.get(f"{prefix}.out", cols=((h0 * p, h1 * p),)).to(dtype)

    def to(self, device: torch.device) -> None:
        for name in ("w_in", "conv_w", "conv_b", "norm_w", "w_out"):
            setattr(self, name, getattr(self, name).to(device))
        self.w_xbc = self.w_in[self.sizes[0] : self.sizes[0] + self.sizes[1]]
        for name in ("dt_bias", "a_log", "d_skip"):
            setattr(self, name, getattr(self, name).to(device))

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
        s, p, n, gs = self.heads, self.head_dim, self.state_dim, self.groups
        z, xbc, dt_raw = F.linear(x, self.w_in).split(self.sizes, dim=-1)
        window = state.conv[lid].T.to(x.dtype)  # [K-1, C]
        k1 = window.shape[0]
        tails = cp.all_gather_ragged(xbc[max(t - k1, 0) :], [min(e - b, k1) for b, e in bounds])
        for tail in tails[: cp.rank]:
            window = advance_window(window, tail)
        after = window
        for tail in tails[cp.rank :]:
            after = advance_window(after, tail)
        conv = causal_conv(xbc, window, self.conv_w, self.conv_b).float()
        conv = conv.view(t, gs, self.sizes[1] // gs)
        xs, B, C = conv.split([s // gs * p, n, n], dim=-1)
        xs = xs.reshape(t, s, p)  # B, C stay per group [T, Gs, N]: the scan shares them
        dt = F.softplus(dt_raw.float() + self.dt_bias)  # [T, S]
        dt = dt.clamp(self.dt_min, self.dt_max)
        A = -torch.exp(self.a_log)
        if t == 1 and cp.size == 1:  # decode: one recurrent step, no chunk machinery
            y, final_state = self._step(xs[0], dt[0], A, B[0], C[0], state.ssm[lid])
        else:
            local = chunked_scan(xs, dt, A, B, C, xs.new_zeros(s, p, n), self.chunk)
            decays = cp.all_gather((dt * A).sum(0))
            states = cp.all_gather(local.final_state)
            chained = combine_chunk_states(decays, states, state.ssm[lid])
            y = local.y + prefix_correction(dt, A, C, chained.initial[cp.rank])
            final_state = chained.final_state
        y = self._output(y + self.d_skip[:, None] * xs, z, tp)
        state.conv[lid] = after.T.contiguous()
        state.ssm[lid] = final_state
        return tp.all_reduce(F.linear(y.reshape(t, s * p).to(x.dtype), self.w_out))

    def decode(self, x: Tensor, states: Sequence[SeqState], tp: AxisComm) -> Tensor:
        """One token per state, ``x`` ``[B, D]``: the batch's projections in one GEMM each,
        the conv and the recurrent step stacked over the batch (each state's own window
        and SSM state). Replaces every ``state.conv/ssm[layer_id]``. Every cp rank runs
        the same tokens: no cp exchange."""
        lid, b = self.layer_id, x.shape[0]
        s, p, n, gs = self.heads, self.head_dim, self.state_dim, self.groups
        z, xbc, dt_raw = F.linear(x, self.w_in).split(self.sizes, dim=-1)
        conv, after = conv_step(
            xbc, [state.conv[lid] for state in states], self.conv_w, self.conv_b
        )
        conv = conv.float().view(b, gs, self.sizes[1] // gs)
        xs, B, C = conv.split([s // gs * p, n, n], dim=-1)
        xs = xs.reshape(b, s, p)
        dt = F.softplus(dt_raw.float() + self.dt_bias).clamp(self.dt_min, self.dt_max)  # [B, S]
        A = -torch.exp(self.a_log)
        ssm = torch.stack([state.ssm[lid] for state in states]).view(b, gs, -1, p, n)
        decay = torch.exp(dt * A).view(b, gs, -1, 1, 1)
        inject = (dt[..., None] * xs).view(b, gs, -1, p, 1) * B[:, :, None, None, :]
        new = decay * ssm + inject
        y = torch.einsum("bgkpn,bgn->bgkp", new, C).reshape(b, s, p)
        new = new.view(b, s, p, n)
        y = self._output(y + self.d_skip[:, None] * xs, z, tp)
        for i, state in enumerate(states):
            state.conv[lid], state.ssm[lid] = after[i], new[i]
        return tp.all_reduce(F.linear(y.reshape(b, s * p).to(x.dtype), self.w_out))

    def _step(
        self, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm: Tensor
    ) -> tuple[Tensor, Tensor]:
        """One token of the recurrence: x ``[S, P]``, dt ``[S]``, B/C ``[Gs, N]``, ssm
        ``[S, P, N]`` -> (y ``[1, S, P]``, the new state). The same math as a one-token
        chunked scan from ``ssm``."""
        gs = self.groups
        s, p, n = ssm.shape
        decay = torch.exp(dt * A).view(gs, -1, 1, 1)
        inject = (dt[:, None] * x).view(gs, -1, p, 1) * B[:, None, None, :]
        new = (decay * ssm.view(gs, -1, p, n) + inject).view(s, p, n)
        y = torch.einsum("gkpn,gn->gkp", new.view(gs, -1, p, n), C).reshape(1, s, p)
        return y, new

    def _output(self, y: Tensor, z: Tensor, tp: AxisComm) -> Tensor:
        """The scan output ``y`` ``[T, S, P]`` (float32) gated by ``silu(z)`` and normed per
        ``self.norm`` (``ModelConfig.ssm_norm``): float32 ``[T, S*P]``."""
        t, s, p = y.shape
        gate = F.silu(z.float().view(t, s, p))
        if self.norm == "none":
            return (y * gate).reshape(t, s * p)
        grouped = (t, self.groups, s * p // self.groups)  # explicit: t may be 0 (empty cp chunk)
        if self.norm == "before_gate":
            normed = self._gated_norm(y.reshape(grouped), tp)
            return (normed.reshape(t, s, p) * gate).reshape(t, s * p)
        return self._gated_norm((y * gate).reshape(grouped), tp).reshape(t, s * p)

    def _gated_norm(self, y: Tensor, tp: AxisComm) -> Tensor:
        # RMS over each whole group [T, Gs, channels]; a group split over tp ranks adds
        # up its ranks' sums of squares (zeros elsewhere) in one all-reduce.
        squares = y.pow(2).sum(-1)  # [T, Gs]
        if self.split_group:
            every = squares.new_zeros(y.shape[0], self.num_groups)
            every[:, self.group0] = squares[:, 0]
            squares = tp.all_reduce(every)[:, self.group0 : self.group0 + 1]
        inv = torch.rsqrt(squares / self.group_channels + self.eps)
        return self.norm_w.float().view(self.groups, -1) * (y * inv[..., None])
