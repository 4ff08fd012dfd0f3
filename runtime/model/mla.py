"""DeepSeek-V3.2 attention: MLA with a lightning indexer choosing the keys (DSA).

Per token the layer caches two small tensors, both the same on every tp rank:

- the **latent** ``[kv_lora_rank + qk_rope_head_dim]``: the RMS-normed compressed KV
  ``c = norm(x @ kv_a)[:Lkv]`` then the one shared RoPE key ``k_rot`` (interleaved-pair
  RoPE, stored as ``[rotated even channels | rotated odd channels]``, as transformers
  caches it). Keys and values are expanded from it per head: ``kv_b(c)`` holds each
  head's ``[k_nope | v]``; a head's key is ``[k_nope | k_rot]``.
- the **indexer key** ``[index_head_dim]``: ``LayerNorm(x @ wk)`` with rotate-half RoPE
  on its first ``qk_rope_head_dim`` channels.

The indexer scores every previous token ``t`` for query ``s`` as
``sum_h w[s, h] * relu(q_idx[s, h] . k_idx[t]) * Di^-0.5`` (``w = x @ weights_proj *
Hi^-0.5``, ``q_idx`` from the compressed query) and keeps the ``index_topk`` best (among
equal scores the lower positions: ``runtime.model.select``; transformers' ``topk`` keeps
an arbitrary shape-dependent subset of tied keys); the
query attends (softmax) to those keys only. Top-k needs every previous token's indexer
key, so under cp the ranks all-gather the new tokens' latents and indexer keys (and the
cached prefix's shards under ``cp_kv="shard"``, in prefill and in decode): every rank
selects over the full prefix, exactly as one rank does.

TP splits the query heads (``q_b`` rows, ``kv_b`` rows, ``o`` columns); the compressed
projections, the latent and the whole indexer are replicated, so the top-k selection is
the same on every tp rank.

Dims: ``T`` query tokens, ``L`` keys (prefix + new), ``D`` d_model, ``H`` local heads,
``Lq``/``Lkv`` q/kv lora ranks, ``N`` nope, ``R`` rope, ``V`` value head dim, ``Hi``/``Di``
indexer heads / head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from mesh_hicache.layout import tp_split
from runtime.model.config import ModelConfig
from runtime.model.layers import rms_norm
from runtime.model.parallel import AxisComm
from runtime.model.select import top_k_mask
from runtime.model.state import AttentionRows, SeqState
from runtime.model.weights import WeightSource

LORA_NORM_EPS = 1e-6
"""DeepSeek's q_a / kv_a RMSNorms and the indexer's LayerNorm use this eps, not the
residual stream's ``rms_norm_eps``."""


def rope_tables(
    positions: Tensor, inv_freq: Tensor, scale: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(cos, sin) ``[T, R/2]`` of the angles ``positions * inv_freq``, times ``scale``."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def rope_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE over interleaved pairs ``(x0, x1), (x2, x3), ...`` of ``x`` ``[T, ..., R]``;
    returns ``[evens rotated | odds rotated]`` (transformers' DeepSeek layout: dot
    products equal the interleaved rotation's)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_halves(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE of the first ``R`` channels of ``x`` ``[T, ..., Di]`` (the
    indexer's layout); the other channels pass."""
    half = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape), sin.view(shape)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class MLAttention:
    """Weights by logical name (under ``prefix``): ``q_a`` ``[Lq, D]``, ``q_a_norm`` ``[Lq]``,
    ``q_b`` ``[heads*(N+R), Lq]``, ``kv_a`` ``[Lkv+R, D]``, ``kv_a_norm`` ``[Lkv]``, ``kv_b``
    ``[heads*(N+V), Lkv]``, ``o`` ``[D, heads*V]``; indexer ``index_q`` ``[Hi*Di, Lq]``,
    ``index_k`` ``[Di, D]``, ``index_norm`` / ``index_norm_bias`` ``[Di]``, ``index_w`` (float32)
    ``[Hi, D]``. ``cp_kv`` / ``page_size`` say which tokens this cp rank keeps (SeqState).
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
        c = config
        self.layer_id = layer_id
        self.cp_kv, self.page_size = cp_kv, page_size
        self.rows = AttentionRows(page_size, cp_kv)
        r = c.qk_rope_head_dim
        default = 1.0 / c.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r)
        self.inv_freq = torch.tensor(c.rope_inv_freq) if c.rope_inv_freq else default
        self.cos_scale = c.rope_cos_scale
        self.nope, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.q_rank, self.kv_rank = c.q_lora_rank, c.kv_lora_rank
        self.index_heads, self.index_dim, self.topk = c.index_heads, c.index_head_dim, c.index_topk
        self.scale = c.attn_scale or c.head_dim**-0.5
        h0, h1 = tp_split(c.num_heads, tp.size, tp.rank)
        self.num_heads = h1 - h0
        qk, kv = self.nope + self.rope_dim, self.nope + self.v_dim
        get, dtype = weights.get, c.dtype
        # One GEMM from x: [q_a | kv_a | index_k] (all replicated over tp). The indexer's
        # head weights stay float32 (as DeepSeek keeps them): they steer the top-k.
        w_in = [get(f"{prefix}.{n}") for n in ("q_a", "kv_a", "index_k")]
        self.index_w = get(f"{prefix}.index_w").float()
        self.sizes = [w.shape[0] for w in w_in]
        self.w_in = torch.cat(w_in).to(dtype)
        self.q_a_norm = get(f"{prefix}.q_a_norm").to(dtype)
        self.kv_a_norm = get(f"{prefix}.kv_a_norm").to(dtype)
        # From the compressed query: this rank's heads, then the indexer's query.
        self.q_b = torch.cat(
            [get(f"{prefix}.q_b", rows=((h0 * qk, h1 * qk),)), get(f"{prefix}.index_q")]
        ).to(dtype)
        self.kv_b = get(f"{prefix}.kv_b", rows=((h0 * kv, h1 * kv),)).to(dtype)
        self.wo = get(f"{prefix}.o", cols=((h0 * self.v_dim, h1 * self.v_dim),)).to(dtype)
        self.index_norm = get(f"{prefix}.index_norm").to(dtype)
        self.index_norm_bias = get(f"{prefix}.index_norm_bias").to(dtype)

    def to(self, device: torch.device) -> None:
        for name in (
            "w_in", "q_a_norm", "kv_a_norm", "q_b", "kv_b", "wo", "index_w", "index_norm",
            "index_norm_bias", "inv_freq",
        ):  # fmt: skip
            setattr(self, name, getattr(self, name).to(device))

    # -- projections --------------------------------------------------------------------------

    def _project_in(self, x: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        """(queries ``[T, H, N+R]``, indexer queries ``[T, Hi, Di]``, indexer head weights
        ``[T, Hi]`` float32, latents ``[T, Lkv+R]``, indexer keys ``[T, Di]``)."""
        t, r = x.shape[0], self.rope_dim
        cos, sin = rope_tables(positions, self.inv_freq, self.cos_scale, x.dtype)
        q_c, ckv, k_idx = F.linear(x, self.w_in).split(self.sizes, dim=-1)
        q_c = rms_norm(q_c, self.q_a_norm, LORA_NORM_EPS)
        q, q_idx = F.linear(q_c, self.q_b).split(
            [self.num_heads * (self.nope + r), self.index_heads * self.index_dim], dim=-1
        )
        q = q.reshape(t, self.num_heads, self.nope + r)
        q = torch.cat([q[..., : self.nope], rope_pairs(q[..., self.nope :], cos, sin)], -1)
        q_idx = rope_halves(q_idx.reshape(t, self.index_heads, self.index_dim), cos, sin)
        kv_c, k_rot = ckv.split([self.kv_rank, r], dim=-1)
        latent = torch.cat(
            [
                rms_norm(kv_c, self.kv_a_norm, LORA_NORM_EPS),
                rope_pairs(k_rot, cos, sin),
            ],
            dim=-1,
        )
        k_idx = F.layer_norm(
            k_idx, (self.index_dim,), self.index_norm, self.index_norm_bias, LORA_NORM_EPS
        )
        k_idx = rope_halves(k_idx, cos, sin)
        # relu(s * a) = a * relu(s) for a > 0: the score scale joins the head weights.
        scale = self.index_heads**-0.5 * self.index_dim**-0.5
        w_idx = F.linear(x.float(), self.index_w) * scale
        return q, q_idx, w_idx, latent, k_idx

    def _select(self, q_idx: Tensor, w_idx: Tensor, k_idx: Tensor, q_pos: Tensor) -> Tensor:
        """Bool ``[T, L]``: the keys each query attends to (its top-k, causal)."""
        scores = torch.matmul(q_idx.float(), k_idx.float().T).relu_()  # [T, Hi, L]
        index = torch.matmul(w_idx.unsqueeze(-2), scores).squeeze(-2)  # [T, L]
        causal = torch.arange(k_idx.shape[0], device=q_pos.device)[None, :] <= q_pos[:, None]
        index = index.masked_fill_(~causal, float("-inf"))
        # Many keys score exactly 0 (every head's relu cut them): ties at the k-th place
        # go to the lower position, so every split of the prompt keeps the same keys.
        return top_k_mask(index, self.topk) & causal

    def _attend(self, q: Tensor, latent: Tensor, allowed: Tensor, dtype: torch.dtype) -> Tensor:
        """Softmax attention of ``q`` over the ``allowed`` keys of ``latent``; returns this
        rank's heads' outputs ``[T, H*V]`` in ``dtype`` (before the output projection).

        Two exact forms, the cheaper one for the shape: *expanded* (``kv_b`` turns every
        key's latent into per-head keys / values: prefill) or *absorbed* (``kv_b`` folds
        into the query and the output, attention runs in the latent space over the
        selected keys only: decode and short suffixes after a long prefix).
        """
        t, length = q.shape[0], latent.shape[0]
        nope, r, v, c = self.nope, self.rope_dim, self.v_dim, self.kv_rank
        expanded = length * c * (nope + v) + t * length * (nope + r + v)
        absorbed = t * c * (nope + v) + t * length * (2 * c + r)
        if absorbed < expanded:
            return self._attend_absorbed(q, latent, allowed, dtype)
        return self._attend_expanded(q, latent, allowed, dtype)

    def _attend_expanded(
        self, q: Tensor, latent: Tensor, allowed: Tensor, dtype: torch.dtype
    ) -> Tensor:
        length = latent.shape[0]
        heads, nope, r, v, c = self.num_heads, self.nope, self.rope_dim, self.v_dim, self.kv_rank
        kv = F.linear(latent[:, :c], self.kv_b).view(length, heads, -1)
        k_nope, values = kv.split([nope, v], dim=-1)
        k_rot = latent[:, None, c:].expand(length, heads, r)
        k = torch.cat([k_nope, k_rot], dim=-1)
        scores = torch.einsum("the,lhe->htl", q.float() * self.scale, k.float())
        scores = scores.masked_fill_(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("htl,lhe->the", probs, values.float())
        return out.flatten(1).to(dtype)

    def _attend_absorbed(
        self, q: Tensor, latent: Tensor, allowed: Tensor, dtype: torch.dtype
    ) -> Tensor:
        c, nope = self.kv_rank, self.nope
        if q.shape[0] == 1:  # one query: keep only its selected keys
            latent = latent[allowed[0].nonzero()[:, 0]]
            allowed = allowed[:, : latent.shape[0]].new_ones(1, latent.shape[0])
        w = self.kv_b.float().view(self.num_heads, nope + self.v_dim, c)
        lat, k_rot = latent[:, :c].float(), latent[:, c:].float()
        q_lat = torch.einsum("thn,hnc->thc", q[..., :nope].float(), w[:, :nope])
        scores = torch.einsum("thc,lc->htl", q_lat, lat)
        scores = scores.add_(torch.einsum("thr,lr->htl", q[..., nope:].float(), k_rot))
        scores = scores.mul_(self.scale).masked_fill_(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("thc,hvc->thv", torch.einsum("htl,lc->thc", probs, lat), w[:, nope:])
        return out.flatten(1).to(dtype)

    # -- forward ------------------------------------------------------------------------------

    def prefill(
        self, x: Tensor, bounds: list[tuple[int, int]], state: SeqState, cp: AxisComm, tp: AxisComm
    ) -> Tensor:
        """Attend this rank's chunk ``x`` ``[T, D]`` (bounds[cp.rank] of the new tokens).

        All-gathers the new latents and indexer keys over cp (under ``shard`` also the
        cached prefix's shards); stores the new tokens' rows this rank keeps
        (``self.rows``: contiguous or paged).
        """
        lid, prefix_len, rows = self.layer_id, state.num_tokens, self.rows
        start, end = bounds[cp.rank]
        positions = torch.arange(prefix_len + start, prefix_len + end, device=x.device)
        q, q_idx, w_idx, latent, k_idx = self._project_in(x, positions)
        lengths = [e - s for s, e in bounds]
        latent_new = torch.cat(cp.all_gather_ragged(latent, lengths))
        k_idx_new = torch.cat(cp.all_gather_ragged(k_idx, lengths))
        latent_all = rows.extend(state, "latent", lid, latent_new, prefix_len, cp)
        k_idx_all = rows.extend(state, "index_k", lid, k_idx_new, prefix_len, cp)
        if q.shape[0]:
            allowed = self._select(q_idx, w_idx, k_idx_all, positions)
            out = F.linear(self._attend(q, latent_all, allowed, x.dtype), self.wo)
        else:
            out = x.new_zeros(0, self.wo.shape[0])
        return tp.all_reduce(out)

    def decode(self, x: Tensor, states: Sequence[SeqState], cp: AxisComm, tp: AxisComm) -> Tensor:
        """One token per state, ``x`` ``[B, D]`` (row i at ``states[i].num_tokens``), the same
        on every cp rank: projections batched, top-k and attention per sequence. Under
        ``shard`` the prefixes are all-gathered, every state's in one collective (top-k
        needs every indexer key), and only the token's owner stores it."""
        lid, rows = self.layer_id, self.rows
        positions = torch.tensor([s.num_tokens for s in states], device=x.device)
        q, q_idx, w_idx, latent, k_idx = self._project_in(x, positions)
        # Every state's prefix (latents, indexer keys): one cp gather for the batch.
        prefixes = rows.gather_batch(list(states), ("latent", "index_k"), lid, cp)
        outs = []
        for i, state in enumerate(states):
            pos, one = state.num_tokens, slice(i, i + 1)
            rows.append(state, "latent", lid, latent[one], pos, cp)
            rows.append(state, "index_k", lid, k_idx[one], pos, cp)
            latent_all = torch.cat([prefixes[i][0], latent[one]])
            k_idx_all = torch.cat([prefixes[i][1], k_idx[one]])
            allowed = self._select(q_idx[one], w_idx[one], k_idx_all, positions[one])
            outs.append(self._attend(q[one], latent_all, allowed, x.dtype))
        return tp.all_reduce(F.linear(torch.cat(outs), self.wo))
