"""Mamba-1 (Jamba's selective scan): the scan math and the mixer.

Dims: ``T`` tokens, ``C`` channels (``d_inner``, local under tp), ``N`` state size, ``R``
the step projection's rank, ``K`` conv kernel.

Recurrence per channel c and state index n (``A[c, n] < 0``; unlike Mamba-2 the decay
differs per state index, so every channel keeps its own ``[N]`` state)::

    S_t[c, n] = exp(dt_t[c] * A[c, n]) * S_{t-1}[c, n] + dt_t[c] * x_t[c] * B_t[n]
    y_t[c]    = sum_n S_t[c, n] * C_t[n] + D[c] * x_t[c]

``dt``, ``B`` and ``C`` come from ``x_proj`` over all channels (under tp a partial sum per
rank, reduced once), each RMS-normalised (Jamba's dt / B / C norms); ``dt`` then goes
through the low-rank ``dt_proj`` and a softplus. The cache keeps the state as
``[C, 1, N]``: to the cache a channel is a head of width 1 (``MambaSpec.mamba1``).

Context parallelism: the update is affine in the entering state with a diagonal
transition, ``S_end = exp(A * sum_t dt_t) * S_in + S_local``; each cp rank scans its
chunk from zero, the ranks chain ``(decay, S_local)`` in order, and a chunk's outputs gain
``sum_n exp(A * cumsum(dt)_t) S_in C_t`` (exact by linearity).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from mesh_hicache.layout import tp_split
from runtime.model.config import ModelConfig
from runtime.model.layers import rms_norm
from runtime.model.parallel import AxisComm
from runtime.model.ssm import advance_window, causal_conv, conv_step
from runtime.model.state import SeqState
from runtime.model.weights import WeightSource

SCAN_ELEMENTS = 1 << 22
"""A block of the scan holds ``L * C * N`` decays, inputs and states; ``L`` is cut to stay
below this."""


class SelectiveResult(NamedTuple):
    """Outputs ``[T, C]`` (without the ``D`` skip) and the state after the last token
    ``[C, N]`` (float32)."""

    y: Tensor
    final_state: Tensor


def naive_selective_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor
) -> SelectiveResult:
    """The recurrence token by token (the reference). ``x``/``dt`` ``[T, C]`` (dt after
    softplus), ``A`` ``[C, N]``, ``B``/``C`` ``[T, N]``, ``state`` ``[C, N]``. float32."""
    ys = []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t][:, None] * A)
        state = decay * state + (dt[t] * x[t])[:, None] * B[t][None, :]
        ys.append(state @ C[t])
    y = torch.stack(ys) if ys else x.new_zeros(x.shape)
    return SelectiveResult(y, state)


def selective_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor, block: int = 0
) -> SelectiveResult:
    """The same recurrence (shapes as :func:`naive_selective_scan`), ``block`` tokens at a
    time: per block the decays ``exp(dt A)`` and inputs ``dt x B`` in bulk, the state
    stepped token by token (two element-wise ops each, as transformers' PyTorch scan), the
    outputs in one contraction. ``block`` 0: as many tokens as keep the block's
    ``[L, C, N]`` tensors below :data:`SCAN_ELEMENTS`. (A chunked quadratic form, as for
    Mamba-2, needs ``[L, L, C, N]`` decays here, since every state index decays at its own
    rate: measured 40x slower at Jamba's sizes.)"""
    c, n = A.shape
    length = block or max(1, SCAN_ELEMENTS // max(c * n, 1))
    ys = []
    for start in range(0, x.shape[0], length):
        sl = slice(start, start + length)
        decay = torch.exp(dt[sl][:, :, None] * A)  # [L, C, N]
        inject = (dt[sl] * x[sl])[:, :, None] * B[sl][:, None, :]
        states = []
        for t in range(decay.shape[0]):
            state = decay[t] * state + inject[t]
            states.append(state)
        ys.append(torch.einsum("tcn,tn->tc", torch.stack(states), C[sl]))
    y = torch.cat(ys) if ys else x.new_zeros(x.shape)
    return SelectiveResult(y, state)


def chain_states(decays: Tensor, local_states: Tensor, carried: Tensor) -> tuple[Tensor, Tensor]:
    """Chain per-chunk ``(log decay [R, C, N], S_local [R, C, N])`` from ``carried``
    ``[C, N]``: (the state entering each chunk ``[R, C, N]``, the final state).
    ``S_in[r+1] = exp(decays[r]) * S_in[r] + S_local[r]``."""
    entering = []
    state = carried
    for r in range(decays.shape[0]):
        entering.append(state)
        state = torch.exp(decays[r]) * state + local_states[r]
    return torch.stack(entering), state


def entering_correction(dt: Tensor, A: Tensor, C: Tensor, entering: Tensor) -> Tensor:
    """What a chunk's outputs ``[T, C]`` gain from the state entering it ``[C, N]``."""
    cum = torch.cumsum(dt, dim=0)[:, :, None] * A  # [T, C, N]
    return torch.einsum("tcn,cn,tn->tc", torch.exp(cum), entering, C)


class Mamba1:
    """The Mamba-1 mixer (Jamba) on one tp rank: channels ``tp_split(d_inner)``.

    Weights, by logical name (``C`` = ``d_inner``): ``x``/``z`` ``[C, D]`` (the two halves
    of ``in_proj``), ``conv_x`` ``[C, K]``, ``conv_bias_x`` ``[C]`` (with ``conv_bias``),
    ``x_proj`` ``[R + 2N, C]``, ``dt_norm`` ``[R]``, ``B_norm``/``C_norm`` ``[N]``, ``dt``
    ``[C, R]`` (``dt_proj``), ``dt_bias`` ``[C]``, ``A_log`` ``[C, N]``, ``D`` ``[C]``,
    ``out`` ``[D, C]``.
    """

    def __init__(
        self, config: ModelConfig, prefix: str, layer_id: int, weights: WeightSource, tp: AxisComm
    ) -> None:
        c, dtype = config, config.dtype
        self.layer_id = layer_id
        self.eps = c.norm_eps
        self.rank_dt, self.state_dim = c.ssm_dt_rank, c.ssm_state_dim
        c0, c1 = tp_split(c.ssm_heads, tp.size, tp.rank)
        self.channels = c1 - c0
        rows = ((c0, c1),)

        def get(name: str, **kw: object) -> Tensor:
            return weights.get(f"{prefix}.{name}", **kw)  # type: ignore[arg-type]

        # One fused input projection [x | z].
        self.w_in = torch.cat([get("x", rows=rows), get("z", rows=rows)]).to(dtype)
        self.conv_w = get("conv_x", rows=rows).to(dtype)
        if c.conv_bias:
            self.conv_b = get("conv_bias_x", rows=rows).to(dtype)
        else:
            self.conv_b = torch.zeros(self.channels, dtype=dtype)
        self.w_xproj = get("x_proj", cols=rows).to(dtype)
        self.dt_norm = get("dt_norm").to(dtype)
        self.b_norm = get("B_norm").to(dtype)
        self.c_norm = get("C_norm").to(dtype)
        self.w_dt = get("dt", rows=rows).to(dtype)
        self.dt_bias = get("dt_bias", rows=rows).float()
        self.a_log = get("A_log", rows=rows).float()
        self.d_skip = get("D", rows=rows).float()
        self.w_out = get("out", cols=rows).to(dtype)

    def to(self, device: torch.device) -> None:
        for name in (
            "w_in", "conv_w", "conv_b", "w_xproj", "dt_norm", "b_norm", "c_norm", "w_dt",
            "dt_bias", "a_log", "d_skip", "w_out",
        ):  # fmt: skip
            setattr(self, name, getattr(self, name).to(device))

    def _ssm_inputs(self, xs: Tensor, tp: AxisComm) -> tuple[Tensor, Tensor, Tensor]:
        """``dt`` ``[T, C]`` (after softplus), ``B``/``C`` ``[T, N]`` (float32) of the conv
        outputs ``xs`` ``[T, C]``: ``x_proj`` reduced over tp (each rank holds a share of
        the channels), the three RMSNorms, then ``dt_proj`` on this rank's channels."""
        n = self.state_dim
        proj = tp.all_reduce(F.linear(xs, self.w_xproj))
        dt, B, C = proj.split([self.rank_dt, n, n], dim=-1)
        dt = rms_norm(dt, self.dt_norm, self.eps)
        B = rms_norm(B, self.b_norm, self.eps)
        C = rms_norm(C, self.c_norm, self.eps)
        dt = F.softplus(F.linear(dt, self.w_dt).float() + self.dt_bias)
        return dt, B.float(), C.float()

    def _output(self, y: Tensor, xs: Tensor, z: Tensor, dtype: torch.dtype, tp: AxisComm) -> Tensor:
        y = (y + self.d_skip * xs) * F.silu(z.float())
        return tp.all_reduce(F.linear(y.to(dtype), self.w_out))

    def forward(
        self, x: Tensor, bounds: list[tuple[int, int]], state: SeqState, cp: AxisComm, tp: AxisComm
    ) -> Tensor:
        """Run this rank's chunk ``x`` ``[T, D]`` (bounds[cp.rank] of the new tokens).

        The conv window entering the chunk comes from the carried conv state and the
        gathered tails of the chunks before it (as for Mamba-2). The scan runs from the
        carried state on one cp rank, else from zero, corrected by the state entering the
        chunk, chained over the gathered (decay, final state) of every chunk.
        ``state.conv/ssm[layer_id]`` become the states after the last new token.
        """
        lid, t = self.layer_id, x.shape[0]
        xin, z = F.linear(x, self.w_in).split(self.channels, dim=-1)
        window = state.conv[lid].T.to(x.dtype)  # [K-1, C]
        k1 = window.shape[0]
        tails = cp.all_gather_ragged(xin[max(t - k1, 0) :], [min(e - b, k1) for b, e in bounds])
        for tail in tails[: cp.rank]:
            window = advance_window(window, tail)
        after = window
        for tail in tails[cp.rank :]:
            after = advance_window(after, tail)
        conv = causal_conv(xin, window, self.conv_w, self.conv_b)
        dt, B, C = self._ssm_inputs(conv, tp)
        xs = conv.float()
        A = -torch.exp(self.a_log)
        carried = state.ssm[lid][:, 0]  # cached [C, 1, N]
        if cp.size == 1:
            y, final = selective_scan(xs, dt, A, B, C, carried)
        else:
            local = selective_scan(xs, dt, A, B, C, torch.zeros_like(carried))
            decays = cp.all_gather(dt.sum(0)[:, None] * A)
            entering, final = chain_states(decays, cp.all_gather(local.final_state), carried)
            y = local.y + entering_correction(dt, A, C, entering[cp.rank])
        state.conv[lid] = after.T.contiguous()
        state.ssm[lid] = final[:, None].contiguous()
        return self._output(y, xs, z, x.dtype, tp)

    def decode(self, x: Tensor, states: Sequence[SeqState], tp: AxisComm) -> Tensor:
        """One token per state, ``x`` ``[B, D]``: projections in one GEMM each, the conv and
        the recurrent step stacked over the batch. Replaces every ``state.conv/ssm``; no cp
        exchange (every cp rank runs the same tokens)."""
        lid = self.layer_id
        xin, z = F.linear(x, self.w_in).split(self.channels, dim=-1)
        conv, after = conv_step(xin, [s.conv[lid] for s in states], self.conv_w, self.conv_b)
        dt, B, C = self._ssm_inputs(conv, tp)  # [B, C], [B, N], [B, N]
        xs = conv.float()
        A = -torch.exp(self.a_log)
        ssm = torch.stack([s.ssm[lid][:, 0] for s in states])  # [B, C, N]
        new = torch.exp(dt[..., None] * A) * ssm + (dt * xs)[..., None] * B[:, None, :]
        y = torch.einsum("bcn,bn->bc", new, C)
        for i, s in enumerate(states):
            s.conv[lid], s.ssm[lid] = after[i], new[i][:, None].contiguous()
        return self._output(y, xs, z, x.dtype, tp)
