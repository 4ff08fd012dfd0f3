"""ParallelMixer: attention and Mamba-2 on the same normed input, outputs summed (Falcon-H1).

A ``P`` layer of ``ModelConfig.layer_pattern``. Both mixers are the ordinary ones, built
under their own weight prefixes (``blocks.b.attn.*``, ``blocks.b.ssm.*``) and sharded
over tp as they are alone; each writes its own state (K/V of the layer, its conv and
recurrent state), so the layer is in both cached families. Falcon-H1's muP multipliers
(attention in/out, key, SSM in/out, per-segment SSM) are linear maps around the
projections: the checkpoint adapter folds them into the projection weights, so nothing
here scales.

One tp all-reduce per layer: attention uses its tp comm only to reduce its output
projection, and Mamba-2 likewise unless its B/C groups are split over tp (its grouped
norm then sums squares over tp first), so both run with a one-rank comm and the sum of
their partial outputs is reduced once; with split groups the two reduce separately.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from runtime.model.layers import Attention, Mamba2
from runtime.model.parallel import AxisComm
from runtime.model.state import SeqState


class ParallelMixer:
    """``attention(x) + recurrent(x)`` for one layer; ``x`` ``[T, D]`` -> ``[T, D]``."""

    def __init__(self, attention: Attention, recurrent: Mamba2) -> None:
        self.attention = attention
        self.recurrent = recurrent
        self.layer_id = attention.layer_id
        self._partial = AxisComm.solo()  # a comm whose all_reduce is the identity

    def to(self, device: torch.device) -> None:
        self.attention.to(device)
        self.recurrent.to(device)

    def prefill(
        self, x: Tensor, bounds: list[tuple[int, int]], state: SeqState, cp: AxisComm, tp: AxisComm
    ) -> Tensor:
        """This rank's chunk (see :meth:`Attention.prefill` / :meth:`Mamba2.forward`);
        extends the layer's K/V and replaces its conv / SSM state."""
        if self.recurrent.split_group:
            attn = self.attention.prefill(x, bounds, state, cp, tp)
            return self.recurrent.forward(x, bounds, state, cp, tp) + attn
        attn = self.attention.prefill(x, bounds, state, cp, self._partial)
        return tp.all_reduce(self.recurrent.forward(x, bounds, state, cp, self._partial) + attn)

    def decode(self, x: Tensor, states: Sequence[SeqState], cp: AxisComm, tp: AxisComm) -> Tensor:
        """One token per state, ``x`` ``[B, D]`` (see :meth:`Attention.decode`)."""
        if self.recurrent.split_group:
            attn = self.attention.decode(x, states, cp, tp)
            return self.recurrent.decode(x, states, tp) + attn
        attn = self.attention.decode(x, states, cp, self._partial)
        return tp.all_reduce(self.recurrent.decode(x, states, self._partial) + attn)
