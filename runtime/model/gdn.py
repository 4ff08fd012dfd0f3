"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): the delta-rule math and the mixer.

Dims: ``T`` tokens, ``H`` value heads (local), ``G`` key heads (local groups), ``Dk`` key
head dim, ``Dv`` value head dim, ``K`` conv kernel, ``R`` cp chunks.

Recurrence per value head (``S`` ``[Dk, Dv]``; q and k L2-normalised, q scaled by
``Dk ** -0.5``; ``g_t <= 0`` the log decay, ``beta_t`` in (0, 1))::

    S_t = exp(g_t) * (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T q_t

The cache keeps ``S`` transposed, ``[H, Dv, Dk]``: to the cache a Gated DeltaNet state is
a recurrent state exactly like Mamba-2's ``[heads, head_dim, state_dim]`` with
``head_dim = Dv`` and ``state_dim = Dk``, and its conv channels are group-major like
Mamba-2's ``[x of the group's heads, B_g, C_g]`` with (v, k, q) in the places of
(x, B, C). One family, no branch on the recurrence (docs/DESIGN.md section 4).

Context parallelism: the state update is affine in the entering state,
``S_end = M S_in + S_local`` with ``M = A_T ... A_1`` (``A_t = exp(g_t)(I - beta_t k_t k_t^T)``,
per head ``[Dk, Dk]``). Each cp rank scans its chunk from zero with the values widened by
``Dk`` zero columns and the state widened by an identity: the extra columns of the final
state are ``M``, the extra output columns are ``P_t^T q_t`` (``P_t`` the prefix transition),
so the correction of an output is ``S_in^T P_t^T q_t``. Exact by linearity; ranks chain
``(M, S_local)`` in order (the scalar-decay combination of the SSM generalised to a matrix).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from mesh_hicache.layout import ssm_group_range, tp_split
from runtime.model.config import ModelConfig
from runtime.model.parallel import AxisComm
from runtime.model.ssm import advance_window, causal_conv, conv_step
from runtime.model.state import SeqState
from runtime.model.weights import WeightSource


class DeltaResult(NamedTuple):
    """Outputs ``[T, H, Dv]`` and the state after the last token ``[H, Dk, Dv]`` (float32)."""

    out: Tensor
    final_state: Tensor


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (float32)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def naive_delta(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> DeltaResult:
    """The gated delta rule token by token (the reference). ``q``/``k`` ``[T, H, Dk]``
    (already normalised and scaled), ``v`` ``[T, H, Dv]``, ``g``/``beta`` ``[T, H]``,
    ``state`` ``[H, Dk, Dv]``. float32."""
    outs = []
    for t in range(q.shape[0]):
        state = torch.exp(g[t])[:, None, None] * state
        predicted = torch.einsum("hkv,hk->hv", state, k[t])
        delta = beta[t][:, None] * (v[t] - predicted)
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    out = torch.stack(outs) if outs else v.new_zeros(v.shape)
    return DeltaResult(out, state)


def delta_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> DeltaResult:
    """One decode token: shapes as :func:`naive_delta` with ``T = 1``."""
    return naive_delta(q, k, v, g, beta, state)


def chunked_delta(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, chunk: int
) -> DeltaResult:
    """The same recurrence ``chunk`` tokens at a time (shapes as :func:`naive_delta`).

    Within a chunk with cumulative log decay ``c_t``, the written values
    ``u_t = beta_t (v_t - S'_t^T k_t)`` solve the unit lower-triangular system
    ``u_t + beta_t sum_{s<t} e^{c_t - c_s} (k_t . k_s) u_s = beta_t (v_t - e^{c_t} S_0^T k_t)``;
    then ``o_t = e^{c_t} S_0^T q_t + sum_{s<=t} e^{c_t - c_s} (q_t . k_s) u_s`` and
    ``S_L = e^{c_L} S_0 + sum_s e^{c_L - c_s} k_s u_s^T``.
    """
    outs = []
    for start in range(0, q.shape[0], chunk):
        sl = slice(start, start + chunk)
        qc, kc, vc = q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1)
        gc, bc = g[sl].T, beta[sl].T  # [H, L]
        length = gc.shape[1]
        cum = torch.cumsum(gc, dim=1)  # [H, L]
        diff = cum[:, :, None] - cum[:, None, :]  # [H, t, s]
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        decay = torch.exp(diff.masked_fill(~causal, float("-inf")))
        strict = decay.tril(-1)
        system = bc[:, :, None] * strict * (kc @ kc.transpose(1, 2))
        grow = torch.exp(cum)[:, :, None]  # [H, L, 1]
        rhs = bc[:, :, None] * (vc - grow * (kc @ state))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out = grow * (qc @ state) + (decay * (qc @ kc.transpose(1, 2))) @ u
        to_end = torch.exp(cum[:, -1:] - cum)[:, :, None]  # [H, L, 1]
        state = torch.exp(cum[:, -1])[:, None, None] * state + (kc * to_end).transpose(1, 2) @ u
        outs.append(out.transpose(0, 1))
    out = torch.cat(outs) if outs else v.new_zeros(v.shape)
    return DeltaResult(out, state)


class ChunkTransitions(NamedTuple):
    """A chunk scanned from zero: outputs ``[T, H, Dv]``, the prefix read-outs
    ``P_t^T q_t`` ``[T, H, Dk]``, the final state ``[H, Dk, Dv]`` and the transition ``M``
    ``[H, Dk, Dk]`` (``S_end = M S_in + final_state``)."""

    out: Tensor
    readout: Tensor
    final_state: Tensor
    transition: Tensor


def scan_with_transition(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk: int
) -> ChunkTransitions:
    """Scan from a zero state and also produce the chunk's state-transition operator."""
    t, h, dk = k.shape
    dv = v.shape[-1]
    values = torch.cat([v, v.new_zeros(t, h, dk)], dim=-1)
    eye = torch.eye(dk, dtype=v.dtype, device=v.device).expand(h, dk, dk)
    start = torch.cat([v.new_zeros(h, dk, dv), eye], dim=-1)
    res = chunked_delta(q, k, values, g, beta, start, chunk)
    out, readout = res.out.split([dv, dk], dim=-1)
    final, transition = res.final_state.split([dv, dk], dim=-1)
    return ChunkTransitions(out, readout, final, transition)


def combine_transitions(
    transitions: Tensor, local_states: Tensor, carried: Tensor
) -> tuple[Tensor, Tensor]:
    """Chain per-chunk ``(M_r [R, H, Dk, Dk], S_local_r [R, H, Dk, Dv])`` from ``carried``
    ``[H, Dk, Dv]``: returns (the state entering each chunk ``[R, H, Dk, Dv]``, the final
    state). ``S_in[r+1] = M_r S_in[r] + S_local_r``."""
    entering = []
    state = carried
    for r in range(transitions.shape[0]):
        entering.append(state)
        state = transitions[r] @ state + local_states[r]
    return torch.stack(entering), state


class GatedDeltaNet:
    """The Gated DeltaNet mixer on one tp rank.

    Value heads ``tp_split(H)`` and key heads (groups) ``ssm_group_range`` (whole groups
    when key heads >= tp, else the one key head of the rank's value heads, replicated).
    Conv channels per local group: ``[v of its local value heads | k_g | q_g]`` (the
    cached conv state's order). Weights, by logical name: ``q.{g}``/``k.{g}`` ``[Dk, D]``,
    ``v.{g}``/``z.{g}`` ``[H/G*Dv, D]``, ``b.{g}``/``a.{g}`` ``[H/G, D]``, ``conv_q.{g}``,
    ``conv_k.{g}``, ``conv_v.{g}`` ``[channels, K]``, ``dt_bias``/``A_log`` ``[H]``, ``gated_norm``
    ``[Dv]`` (gated RMSNorm over each value head), ``out`` ``[D, H*Dv]``.
    """

    def __init__(
        self, config: ModelConfig, prefix: str, layer_id: int, weights: WeightSource, tp: AxisComm
    ) -> None:
        c = config
        dv, dk = c.ssm_head_dim, c.ssm_state_dim
        self.layer_id, self.dv, self.dk = layer_id, dv, dk
        self.chunk, self.eps = c.scan_chunk, c.norm_eps
        h0, h1 = tp_split(c.ssm_heads, tp.size, tp.rank)
        g0, g1 = ssm_group_range(c.num_groups, tp.size, tp.rank)
        per = c.ssm_heads // c.num_groups
        self.heads, self.groups = h1 - h0, g1 - g0
        z_rows, v_rows, conv_rows, b_rows = [], [], [], []
        for g in range(g0, g1):
            a, b = max(g * per, h0) - g * per, min((g + 1) * per, h1) - g * per
            v_rows.append((f"v.{g}", (a * dv, b * dv)))
            z_rows.append((f"z.{g}", (a * dv, b * dv)))
            b_rows.append((g, (a, b)))
            conv_rows += [(f"v.{g}", (a * dv, b * dv)), (f"k.{g}", (0, dk)), (f"q.{g}", (0, dk))]

        def get(name: str, rows: tuple[int, int]) -> Tensor:
            return weights.get(f"{prefix}.{name}", rows=(rows,))

        w_z = torch.cat([get(n, r) for n, r in z_rows])
        w_conv_in = torch.cat([get(n, r) for n, r in conv_rows])
        w_b = torch.cat([get(f"b.{g}", r) for g, r in b_rows])
        w_a = torch.cat([get(f"a.{g}", r) for g, r in b_rows])
        self.sizes = (w_z.shape[0], w_conv_in.shape[0], w_b.shape[0], w_a.shape[0])
        self.w_in = torch.cat([w_z, w_conv_in, w_b, w_a]).to(c.dtype)
        self.conv_w = torch.cat([get(f"conv_{n}", r) for n, r in conv_rows]).to(c.dtype)
        self.conv_b = torch.zeros(self.conv_w.shape[0], dtype=c.dtype)
        self.dt_bias = weights.get(f"{prefix}.dt_bias", rows=((h0, h1),)).float()
        self.a_log = weights.get(f"{prefix}.A_log", rows=((h0, h1),)).float()
        self.norm_w = weights.get(f"{prefix}.gated_norm").to(c.dtype)
        self.w_out = weights.get(f"{prefix}.out", cols=((h0 * dv, h1 * dv),)).to(c.dtype)

    def to(self, device: torch.device) -> None:
        for name in ("w_in", "conv_w", "conv_b", "dt_bias", "a_log", "norm_w", "w_out"):
            setattr(self, name, getattr(self, name).to(device))

    def forward(
        self, x: Tensor, bounds: list[tuple[int, int]], state: SeqState, cp: AxisComm, tp: AxisComm
    ) -> Tensor:
        """Run this rank's chunk ``x`` ``[T, D]`` (bounds[cp.rank] of the new tokens).

        The conv window and halo are exchanged as in the Mamba-2 mixer; the delta rule
        runs from the carried state on one cp rank, else from zero with the chunk's
        transition, chained over cp. ``state.conv/ssm[layer_id]`` become the states after
        the last new token (the same on every cp rank). Decode: one token, one-rank cp.
        """
        lid, t = self.layer_id, x.shape[0]
        hl, gs, dv, dk = self.heads, self.groups, self.dv, self.dk
        z, mixed, b, a = F.linear(x, self.w_in).split(self.sizes, dim=-1)
        window = state.conv[lid].T.to(x.dtype)  # [K-1, C]
        k1 = window.shape[0]
        tails = cp.all_gather_ragged(mixed[max(t - k1, 0) :], [min(e - s, k1) for s, e in bounds])
        for tail in tails[: cp.rank]:
            window = advance_window(window, tail)
        after = window
        for tail in tails[cp.rank :]:
            after = advance_window(after, tail)
        conv = causal_conv(mixed, window, self.conv_w, self.conv_b).float()
        conv = conv.view(t, gs, self.sizes[1] // gs)
        v, k, q = conv.split([hl // gs * dv, dk, dk], dim=-1)
        v = v.reshape(t, hl, dv)
        k = l2norm(k).repeat_interleave(hl // gs, dim=1)
        q = l2norm(q).repeat_interleave(hl // gs, dim=1) * dk**-0.5
        beta = torch.sigmoid(b.float())
        g = -torch.exp(self.a_log) * F.softplus(a.float() + self.dt_bias)
        carried = state.ssm[lid].transpose(1, 2)  # cached [H, Dv, Dk] -> [H, Dk, Dv]
        if cp.size == 1:
            if t == 1:
                res = delta_step(q, k, v, g, beta, carried)
            else:
                res = chunked_delta(q, k, v, g, beta, carried, self.chunk)
            out, final = res.out, res.final_state
        else:
            local = scan_with_transition(q, k, v, g, beta, self.chunk)
            entering, final = combine_transitions(
                cp.all_gather(local.transition), cp.all_gather(local.final_state), carried
            )
            out = local.out + torch.einsum("thk,hkv->thv", local.readout, entering[cp.rank])
        state.conv[lid] = after.T.contiguous()
        state.ssm[lid] = final.transpose(1, 2).contiguous()
        out = out.to(x.dtype).float()
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.norm_w * normed.to(x.dtype)
        y = y.float() * F.silu(z.float().view(t, hl, dv))
        return tp.all_reduce(F.linear(y.reshape(t, hl * dv).to(x.dtype), self.w_out))

    def decode(self, x: Tensor, states: Sequence[SeqState], tp: AxisComm) -> Tensor:
        """One token per state, ``x`` ``[B, D]``: projections in one GEMM each, the conv and
        the delta-rule step stacked over the batch. Replaces every
        ``state.conv/ssm[layer_id]``; no cp exchange (every cp rank runs the same tokens)."""
        lid, n = self.layer_id, x.shape[0]
        hl, gs, dv, dk = self.heads, self.groups, self.dv, self.dk
        z, mixed, b, a = F.linear(x, self.w_in).split(self.sizes, dim=-1)
        conv, after = conv_step(mixed, [s.conv[lid] for s in states], self.conv_w, self.conv_b)
        v, k, q = conv.float().view(n, gs, -1).split([hl // gs * dv, dk, dk], dim=-1)
        v = v.reshape(n, hl, dv)
        k = l2norm(k).repeat_interleave(hl // gs, dim=1)
        q = l2norm(q).repeat_interleave(hl // gs, dim=1) * dk**-0.5
        beta = torch.sigmoid(b.float())  # [B, H]
        g = -torch.exp(self.a_log) * F.softplus(a.float() + self.dt_bias)
        # The step of naive_delta, for the batch: cached [H, Dv, Dk] -> [B, H, Dk, Dv].
        state = torch.stack([s.ssm[lid] for s in states]).transpose(2, 3)
        state = torch.exp(g)[..., None, None] * state
        predicted = torch.einsum("bhkv,bhk->bhv", state, k)
        delta = beta[..., None] * (v - predicted)
        state = state + k[..., None] * delta[:, :, None, :]
        out = torch.einsum("bhkv,bhk->bhv", state, q)
        cached = state.transpose(2, 3).contiguous()
        for i, s in enumerate(states):
            s.conv[lid], s.ssm[lid] = after[i], cached[i]
        out = out.to(x.dtype).float()
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.norm_w * normed.to(x.dtype)
        y = y.float() * F.silu(z.float().view(n, hl, dv))
        return tp.all_reduce(F.linear(y.reshape(n, hl * dv).to(x.dtype), self.w_out))
