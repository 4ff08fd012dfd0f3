"""Mamba-2 style SSM math: causal conv, chunked scan, naive reference, CP combination.

Pure functions on one sequence, no parameters and no communication, so that the tests
can check each piece against a reference and the layer (``layers.py``) can split the
work over cp ranks.

Dims: ``T`` tokens, ``H`` heads, ``P`` head channels, ``N`` state size, ``C`` conv
channels, ``K`` conv kernel, ``R`` cp chunks. B and C are per head (n_groups = H).

Recurrence, per head h (``a_t = exp(dt_t * A_h)``, ``A_h < 0``)::

    S_t = a_t * S_{t-1} + dt_t * outer(x_t, B_t)      # S: [P, N]
    y_t = S_t @ C_t                                    # y: [P]
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


class ScanResult(NamedTuple):
    """Output of a scan: ``y`` ``[T, H, P]`` and the state after the last token ``[H, P, N]``."""

    y: Tensor
    final_state: Tensor


# -- causal depthwise conv ------------------------------------------------------------------


def causal_conv(xbc: Tensor, window: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """Causal depthwise conv with SiLU: ``out[t] = silu(sum_k w[:, k] * in[t + k] + bias)``.

    ``xbc`` ``[T, C]`` new inputs, ``window`` ``[K-1, C]`` the K-1 inputs before them
    (oldest first; zeros at the start of a sequence), ``weight`` ``[C, K]``, ``bias`` ``[C]``.
    Returns ``[T, C]``.
    """
    if xbc.shape[0] == 0:  # conv1d rejects inputs shorter than the kernel
        return xbc.clone()
    inputs = torch.cat([window, xbc], dim=0).T.unsqueeze(0)  # [1, C, K-1+T]
    out = F.conv1d(inputs, weight.unsqueeze(1), bias, groups=weight.shape[0])
    return F.silu(out[0].T)


def conv_step(
    xbc: Tensor, windows: list[Tensor], weight: Tensor, bias: Tensor
) -> tuple[Tensor, Tensor]:
    """One token of :func:`causal_conv` for each of B sequences: ``xbc`` ``[B, C]``, each
    sequence's window ``[C, K-1]`` (the cached conv state's layout). Returns (outputs
    ``[B, C]``, the windows after the token ``[B, C, K-1]``), in ``xbc.dtype``."""
    inputs = torch.cat([torch.stack(windows).to(xbc.dtype), xbc[:, :, None]], dim=2)  # [B, C, K]
    # One output per channel: a multiply-add over K (CPU conv1d costs ~10x more here).
    out = (inputs * weight).sum(-1)
    return F.silu(out + bias), inputs[:, :, 1:].contiguous()


def advance_window(window: Tensor, xbc: Tensor) -> Tensor:
    """The conv window after ``xbc``: the last K-1 rows of ``cat(window, xbc)`` ``[K-1, C]``.

    Correct for any ``len(xbc)``, including fewer rows than K-1 (and zero).
    """
    k1 = window.shape[0]
    return torch.cat([window, xbc], dim=0)[-k1:]


# -- scans ------------------------------------------------------------------------------------


def naive_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor) -> ScanResult:
    """The recurrence token by token (the reference). float32 in and out.

    ``x`` ``[T, H, P]``, ``dt`` ``[T, H]`` (after softplus), ``A`` ``[H]`` (negative),
    ``B``/``C`` ``[T, H, N]``, ``state`` ``[H, P, N]`` before the first token.
    """
    ys = []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t] * A)[:, None, None]
        state = decay * state + dt[t][:, None, None] * x[t][:, :, None] * B[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", state, C[t]))
    y = torch.stack(ys) if ys else x.new_zeros(x.shape)
    return ScanResult(y, state)


def chunked_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor, chunk: int
) -> ScanResult:
    """The same recurrence, ``chunk`` tokens at a time (quadratic within a chunk).

    Shapes as :func:`naive_scan`, except that ``B``/``C`` may be per group ``[T, G, N]``
    (G divides H; heads ``[g*H/G, (g+1)*H/G)`` share group g), which is computed once
    per group rather than repeated per head. Within a chunk, with ``L_t`` the cumulative
    log decay, ``y_t = sum_{s<=t} exp(L_t - L_s) dt_s (C_t . B_s) x_s + exp(L_t) S_0 @ C_t``;
    the state then moves to the chunk's end and carries into the next.
    """
    h, p = x.shape[1], x.shape[2]
    g, n = B.shape[1], B.shape[2]
    k = h // g
    ys = []
    for start in range(0, x.shape[0], chunk):
        sl = slice(start, start + chunk)
        xc, dtc, Bc, Cc = x[sl], dt[sl], B[sl], C[sl]
        cum = torch.cumsum(dtc * A, dim=0)  # [L, H]
        length = cum.shape[0]
        diff = cum[:, None, :] - cum[None, :, :]  # [t, s, H]: L_t - L_s
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        # Mask before exp: the upper triangle's differences are positive and may overflow.
        decay = torch.exp(diff.masked_fill(~causal[:, :, None], float("-inf")))
        cb = torch.einsum("tgn,sgn->tsg", Cc, Bc)
        if k > 1:
            cb = cb.repeat_interleave(k, dim=2)
        y = torch.einsum("tsh,shp->thp", cb * decay * dtc[None, :, :], xc)
        y0 = torch.einsum("gkpn,tgn->tgkp", state.view(g, k, p, n), Cc).reshape(length, h, p)
        y = y + torch.exp(cum)[:, :, None] * y0
        to_end = (torch.exp(cum[-1][None, :] - cum) * dtc).view(length, g, k)
        update = torch.einsum("sgk,sgkp,sgn->gkpn", to_end, xc.view(length, g, k, p), Bc)
        state = torch.exp(cum[-1])[:, None, None] * state + update.reshape(h, p, n)
        ys.append(y)
    y = torch.cat(ys) if ys else x.new_zeros(x.shape)
    return ScanResult(y, state)


# -- context parallelism: local scans from zero, then the exact prefix correction -------------


class ChunkStates(NamedTuple):
    """Per cp chunk the state entering it ``[R, H, P, N]``, and the state after all chunks."""

    initial: Tensor
    final_state: Tensor


def combine_chunk_states(log_decays: Tensor, local_states: Tensor, carried: Tensor) -> ChunkStates:
    """Chain chunk summaries into the true state entering each chunk.

    ``log_decays`` ``[R, H]``: sum of ``dt * A`` over each chunk (0 for an empty chunk);
    ``local_states`` ``[R, H, P, N]``: each chunk's final state when scanned from zero;
    ``carried`` ``[H, P, N]``: the state before the first chunk (a cached prefix's state).
    ``S_in[0] = carried``, ``S_in[r+1] = exp(log_decays[r]) * S_in[r] + local_states[r]``.
    """
    entering = []
    state = carried
    for r in range(log_decays.shape[0]):
        entering.append(state)
        state = torch.exp(log_decays[r])[:, None, None] * state + local_states[r]
    return ChunkStates(torch.stack(entering), state)


def prefix_correction(dt: Tensor, A: Tensor, C: Tensor, entering: Tensor) -> Tensor:
    """What a chunk's outputs gain from the state entering it: ``[T, H, P]`` (``C`` per
    head ``[T, H, N]`` or per group ``[T, G, N]``).

    Adding this to a scan from zero gives the scan from ``entering`` (exact, by linearity):
    ``y_t += exp(sum_{s<=t} dt_s A) * entering @ C_t``.
    """
    cum = torch.cumsum(dt * A, dim=0)
    (t, h), (g, n) = dt.shape, C.shape[1:]
    p = entering.shape[1]
    per_group = entering.view(g, h // g, p, n)
    out = torch.einsum("gkpn,tgn->tgkp", per_group, C).reshape(t, h, p)
    return torch.exp(cum)[:, :, None] * out
