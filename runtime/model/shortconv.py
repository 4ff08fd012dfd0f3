"""LFM2's gated short convolution: the mixer of its ``conv`` layers.

Per token ``t`` (``D`` channels, kernel ``K`` = LFM2's ``L_cache``)::

    B, C, x = in_proj(h)            # three [D] blocks of one projection
    u_t     = B_t * x_t
    c_t     = sum_k w[:, k] * u_{t-K+1+k} (+ bias)     # causal depthwise conv, no activation
    out_t   = out_proj(C_t * c_t)

The only state is the conv window: the last ``K - 1`` inputs ``u`` ``[D, K-1]`` (oldest
first), cached as the recurrent family's conv state with no recurrent tensor
(``MambaSpec.short_conv``). Every channel is independent, so tp shards the channels
(contiguous blocks, ``tp_split(D)``) and reduces the output projection; cp exchanges only
the last ``K - 1`` inputs of each chunk, as the Mamba-2 mixer does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from mesh_hicache.layout import tp_split
from runtime.model.config import ModelConfig
from runtime.model.parallel import AxisComm
from runtime.model.ssm import advance_window
from runtime.model.state import SeqState
from runtime.model.weights import WeightSource


def short_conv(u: Tensor, window: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Causal depthwise conv without activation: ``u`` ``[T, C]`` new inputs, ``window``
    ``[K-1, C]`` the inputs before them, ``weight`` ``[C, K]``. Returns ``[T, C]``."""
    if u.shape[0] == 0:  # conv1d rejects inputs shorter than the kernel
        return u.clone()
    inputs = torch.cat([window, u], dim=0).T.unsqueeze(0)  # [1, C, K-1+T]
    return F.conv1d(inputs, weight.unsqueeze(1), bias, groups=weight.shape[0])[0].T


class ShortConv:
    """The gated short convolution on one tp rank (channels ``tp_split(D)``).

    Weights, by logical name: ``B``, ``C``, ``x`` ``[D, D]`` (rows: channels), ``conv``
    ``[D, K]``, ``out`` ``[D, D]`` (columns: channels); with ``conv_bias`` also ``B_bias``,
    ``C_bias``, ``x_bias``, ``conv_bias`` and ``out_bias`` ``[D]``.
    """

    def __init__(
        self, config: ModelConfig, prefix: str, layer_id: int, weights: WeightSource, tp: AxisComm
    ) -> None:
        c = config
        self.layer_id = layer_id
        c0, c1 = tp_split(c.ssm_heads, tp.size, tp.rank)
        rows = ((c0, c1),)
        self.channels = c1 - c0

        def get(name: str) -> Tensor:
            return weights.get(f"{prefix}.{name}", rows=rows).to(c.dtype)

        self.w_in = torch.cat([get("B"), get("C"), get("x")])  # one GEMM for B, C, x
        self.conv_w = get("conv")
        self.b_in: Tensor | None = None
        self.conv_b: Tensor | None = None
        self.out_b: Tensor | None = None
        if c.conv_bias:
            self.b_in = torch.cat([get("B_bias"), get("C_bias"), get("x_bias")])
            self.conv_b = get("conv_bias")
            self.out_b = weights.get(f"{prefix}.out_bias").to(c.dtype)
        self.w_out = weights.get(f"{prefix}.out", cols=rows).to(c.dtype)

    def to(self, device: torch.device) -> None:
        for name in ("w_in", "conv_w", "b_in", "conv_b", "out_b", "w_out"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))

    def _out(self, y: Tensor, tp: AxisComm) -> Tensor:
        out = tp.all_reduce(F.linear(y, self.w_out))
        return out + self.out_b if self.out_b is not None else out

    def forward(
        self, x: Tensor, bounds: list[tuple[int, int]], state: SeqState, cp: AxisComm, tp: AxisComm
    ) -> Tensor:
        """Run this rank's chunk ``x`` ``[T, D]`` (bounds[cp.rank] of the new tokens).

        The window entering the chunk is the carried conv state advanced by the gathered
        tails (last K-1 inputs) of the chunks before it; ``state.conv[layer_id]`` becomes
        the window after the last new token (the same on every cp rank)."""
        lid, t = self.layer_id, x.shape[0]
        b, c, xs = F.linear(x, self.w_in, self.b_in).split(self.channels, dim=-1)
        u = b * xs
        window = state.conv[lid].T.to(x.dtype)  # [K-1, C]
        k1 = window.shape[0]
        tails = cp.all_gather_ragged(u[max(t - k1, 0) :], [min(e - s, k1) for s, e in bounds])
        for tail in tails[: cp.rank]:
            window = advance_window(window, tail)
        after = window
        for tail in tails[cp.rank :]:
            after = advance_window(after, tail)
        conv = short_conv(u, window, self.conv_w, self.conv_b)
        state.conv[lid] = after.T.contiguous()
        return self._out(c * conv, tp)

    def decode(self, x: Tensor, states: Sequence[SeqState], tp: AxisComm) -> Tensor:
        """One token per state, ``x`` ``[B, D]``: one GEMM per projection for the batch, the
        conv as a multiply-add over the stacked windows. Replaces every
        ``state.conv[layer_id]``; no cp exchange (every cp rank runs the same tokens)."""
        lid = self.layer_id
        b, c, xs = F.linear(x, self.w_in, self.b_in).split(self.channels, dim=-1)
        u = b * xs
        windows = torch.stack([s.conv[lid] for s in states]).to(x.dtype)  # [B, C, K-1]
        inputs = torch.cat([windows, u[:, :, None]], dim=2)  # [B, C, K]
        conv = (inputs * self.conv_w).sum(-1)
        if self.conv_b is not None:
            conv = conv + self.conv_b
        after = inputs[:, :, 1:]
        for i, s in enumerate(states):
            s.conv[lid] = after[i].contiguous()
        return self._out(c * conv, tp)
