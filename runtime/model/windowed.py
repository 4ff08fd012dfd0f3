"""Local/global attention: GQA whose layers are either full or sliding-window (gpt-oss,
Gemma 3), with the options those models add.

:class:`WindowedAttention` is :class:`~runtime.model.layers.Attention` (same K/V rows,
paging and cp code) plus, by config: a per-layer window W (a query at position p sees
keys ``p - W < k <= p``), per-head attention sinks (a learned logit that joins the softmax
denominator and carries no value), q/k/v/o biases, per-head q/k RMSNorm and a per-layer
RoPE (the windowed layers' own base; YaRN or scaled frequencies on the full layers).

The K/V of every token is kept (a windowed layer reads only the last W of them), so the
cache stores a windowed layer's pages like a full layer's.

Dims as ``layers.py``: ``T`` tokens, ``H``/``G`` local query/KV heads, ``E`` head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from mesh_hicache.layout import tp_split
from runtime.model.config import ModelConfig
from runtime.model.layers import Attention, default_inv_freq
from runtime.model.parallel import AxisComm, kv_shard_positions
from runtime.model.state import SeqState
from runtime.model.weights import WeightSource

QUERY_BLOCK = 128
"""Queries per block of a prefill's attention: scores of one block are ``H x 128 x keys``
floats, so a long prompt never materialises a ``T x T`` score matrix per head."""


def grouped_attention(
    q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor, k_pos: Tensor, scale: float, window: int
) -> tuple[Tensor, Tensor]:
    """GQA of ``q`` ``[T, H, E]`` (at ``q_pos``) over ``k``/``v`` ``[L, G, E]`` (at ``k_pos``):
    a key is visible iff ``q - window < k <= q`` (``window`` 0: ``k <= q``). Each KV head's
    query heads form one matmul row block (no K/V copy per query head). Returns float32
    ``out`` ``[T, H, E]`` and ``lse`` ``[T, H]`` (``-inf`` and 0 where no key is visible)."""
    t, heads, e = q.shape
    g = k.shape[1]
    rep = heads // g
    qf = q.float().view(t, g, rep, e).permute(1, 2, 0, 3).reshape(g, rep * t, e)
    kf, vf = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [G, L, E]
    scores = torch.matmul(qf, kf.transpose(1, 2)).mul_(scale)  # [G, rep*T, L]
    pos = q_pos.repeat(rep)[:, None]  # [rep*T, 1]
    hidden = k_pos[None, :] > pos
    if window:
        hidden = hidden | (k_pos[None, :] <= pos - window)
    scores = scores.masked_fill_(hidden[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [G, rep*T]
    probs = torch.exp(scores - lse[..., None]).nan_to_num_(0.0)
    out = torch.matmul(probs, vf)  # [G, rep*T, E]
    out = out.view(g, rep, t, e).permute(2, 0, 1, 3).reshape(t, heads, e)
    return out, lse.view(g, rep, t).permute(2, 0, 1).reshape(t, heads)


def merge_with_lse(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """Merge partial attentions ``outs`` ``[R, T, H, E]`` / ``lses`` ``[R, T, H]`` into the
    attention over all their keys and its log-sum-exp (``-inf`` where no key was seen)."""
    top = lses.max(dim=0).values
    safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lses - safe[None])  # 0 for empty partials
    total = weights.sum(0)
    out = (weights[..., None] * outs).sum(0) / total.clamp_min(1e-30)[..., None]
    return out, safe + torch.log(total)


def apply_sinks(out: Tensor, lse: Tensor, sinks: Tensor | None) -> Tensor:
    """Attention ``out`` ``[T, H, E]`` over keys of log-sum-exp ``lse`` ``[T, H]`` with a sink
    logit per head ``sinks`` ``[H]`` in the denominator: ``out * Z / (Z + exp(sink))``."""
    if sinks is None:
        return out
    return out * torch.sigmoid(lse - sinks[None, :])[..., None]


class WindowedAttention(Attention):
    """Weights by logical name: ``q`` ``[H*E, D]``, ``k``/``v`` ``[G*E, D]``, ``o`` ``[D, H*E]``;
    with ``attn_bias`` also ``q_bias``/``k_bias``/``v_bias``/``o_bias``; with ``attn_sinks``
    ``sinks`` ``[H]``; with ``qk_norm`` ``q_norm``/``k_norm`` ``[E]`` (plus ``norm_offset``)."""

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
        super().__init__(config, prefix, layer_id, weights, tp, cp_kv=cp_kv, page_size=page_size)
        c = config
        self.window = c.window(layer_id)
        self.o_bias: Tensor | None = None
        if c.attn_bias:
            o_bias = weights.get(f"{prefix}.o_bias").to(c.dtype)
            # Added by tp rank 0 only: the reduced sum holds it once.
            self.o_bias = o_bias if tp.rank == 0 else torch.zeros_like(o_bias)
        self.sinks: Tensor | None = None
        if c.attn_sinks:
            q0, q1 = tp_split(c.num_heads, tp.size, tp.rank)
            self.sinks = weights.get(f"{prefix}.sinks", rows=((q0, q1),)).float()
        if self.window and c.local_rope_theta:  # the windowed layers' own plain RoPE
            self.inv_freq, self.cos_scale = default_inv_freq(c.local_rope_theta, c.rope_dim), 1.0

    def to(self, device: torch.device) -> None:
        super().to(device)
        for name in ("o_bias", "sinks"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))

    def _project(self, out: Tensor, dtype: torch.dtype, tp: AxisComm) -> Tensor:
        return tp.all_reduce(F.linear(out.flatten(1).to(dtype), self.wo, self.o_bias))

    def _first_key(self, position: int) -> int:
        """The first key position a query at ``position`` sees."""
        return max(0, position - self.window + 1) if self.window else 0

    def _attend_all(
        self, q: Tensor, q_pos: Tensor, keys: Tensor, values: Tensor, first: int = 0
    ) -> Tensor:
        # q [T, H, E] at consecutive positions q_pos over the keys at first..first+L-1, in
        # blocks of queries (bounded score memory); each block uses only the keys it sees.
        outs = []
        for b0 in range(0, q.shape[0], QUERY_BLOCK):
            b1 = min(b0 + QUERY_BLOCK, q.shape[0])
            lo, hi = self._first_key(int(q_pos[b0])), int(q_pos[b1 - 1]) + 1
            assert lo >= first, (lo, first)
            k_pos = torch.arange(lo, hi, device=q.device)
            out, lse = grouped_attention(
                q[b0:b1],
                q_pos[b0:b1],
                keys[lo - first : hi - first],
                values[lo - first : hi - first],
                k_pos,
                self.scale,
                self.window,
            )
            outs.append(apply_sinks(out, lse, self.sinks))
        return torch.cat(outs)

    def prefill(
        self, x: Tensor, bounds: list[tuple[int, int]], state: SeqState, cp: AxisComm, tp: AxisComm
    ) -> Tensor:
        """As :meth:`Attention.prefill`, attending within the window and with the sinks."""
        lid, prefix_len, rows = self.layer_id, state.num_tokens, self.rows
        start, end = bounds[cp.rank]
        positions = torch.arange(prefix_len + start, prefix_len + end, device=x.device)
        q, k, v = self._qkv(x, positions)
        lengths = [e - s for s, e in bounds]
        k_new = torch.cat(cp.all_gather_ragged(k, lengths))
        v_new = torch.cat(cp.all_gather_ragged(v, lengths))
        end = prefix_len + k_new.shape[0]
        if self.window and not rows.sharded(cp):
            # Store every new row, read back only the keys this rank's queries can see.
            lo = self._first_key(prefix_len + start)
            rows.append(state, "k", lid, k_new, prefix_len, cp)
            rows.append(state, "v", lid, v_new, prefix_len, cp)
            k_all = rows.read_range(state, "k", lid, lo, end)
            v_all = rows.read_range(state, "v", lid, lo, end)
        else:
            lo = 0
            k_all = rows.extend(state, "k", lid, k_new, prefix_len, cp)
            v_all = rows.extend(state, "v", lid, v_new, prefix_len, cp)
        out = self._attend_all(q, positions, k_all, v_all, lo) if q.shape[0] else q.float()
        return self._project(out, x.dtype, tp)

    def decode(self, x: Tensor, states: Sequence[SeqState], cp: AxisComm, tp: AxisComm) -> Tensor:
        """As :meth:`Attention.decode`; under ``shard`` the partials are merged by
        log-sum-exp before the sinks join the denominator."""
        lid, rows = self.layer_id, self.rows
        positions = torch.tensor([s.num_tokens for s in states], device=x.device)
        q, k, v = self._qkv(x, positions)
        if not rows.sharded(cp):
            outs = []
            for i, state in enumerate(states):
                pos = state.num_tokens
                rows.append(state, "k", lid, k[i : i + 1], pos, cp)
                rows.append(state, "v", lid, v[i : i + 1], pos, cp)
                lo = self._first_key(pos)  # only the window's pages are read
                keys = rows.read_range(state, "k", lid, lo, pos + 1)
                values = rows.read_range(state, "v", lid, lo, pos + 1)
                outs.append(self._attend_all(q[i : i + 1], positions[i : i + 1], keys, values, lo))
            return self._project(torch.cat(outs), x.dtype, tp)
        parts = []
        for i, state in enumerate(states):
            pos = state.num_tokens
            rows.append(state, "k", lid, k[i : i + 1], pos, cp)
            rows.append(state, "v", lid, v[i : i + 1], pos, cp)
            keys = rows.read(state, "k", lid, pos + 1, cp)
            values = rows.read(state, "v", lid, pos + 1, cp)
            k_pos = kv_shard_positions(pos + 1, self.page_size, cp.size, cp.rank).to(x.device)
            out, lse = grouped_attention(
                q[i : i + 1], positions[i : i + 1], keys, values, k_pos, self.scale, self.window
            )
            parts.append(torch.cat([out, lse[..., None]], dim=-1))
        gathered = cp.all_gather(torch.cat(parts))  # [cp, B, H, E + 1]
        out, lse = merge_with_lse(gathered[..., :-1], gathered[..., -1])
        return self._project(apply_sinks(out, lse, self.sinks), x.dtype, tp)
