"""Placements -> local shard shape, global slice, writer election (DESIGN.md section 4).

(Work in progress: only ``GlobalSlice`` so far.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GlobalSlice:
    """The part of one family's global per-page (or per-slot) object that a shard holds.

    Half-open ranges in global (whole-model) coordinates; no rank numbers. ``heads`` is
    the KV head range (KV), SSM head range (MAMBA; conv channels follow the heads) or
    ``(0, 1)`` for head-less families; ``tokens`` is the token-in-page range (``(0, 1)``
    for MAMBA, whose objects are per boundary, not per token).
    """

    layers: tuple[int, int]
    heads: tuple[int, int]
    tokens: tuple[int, int]

    def tag(self) -> str:
        """A stable, filename-safe text form used in storage keys, e.g. ``L0-4.H2-4.T0-16``."""
        (l0, l1), (h0, h1), (t0, t1) = self.layers, self.heads, self.tokens
        return f"L{l0}-{l1}.H{h0}-{h1}.T{t0}-{t1}"
