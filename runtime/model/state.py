"""SeqState: one request's model state on one rank; its attention state either contiguous
(in the state's own tensors) or paged (in the L1 device pools, through a :class:`PageTable`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from mesh_hicache.pools.device import DevicePools


@dataclass(slots=True)
class PageTable:
    """Where a request's attention state lives: the L1 device pools and the request's pages.

    ``pages[i]`` is the device page holding tokens ``[i * page_size, (i + 1) * page_size)``
    (this cp rank's in-page rows of them under ``cp_kv="shard"``). The pages must cover every
    token the model will write; the model reads and writes them, never allocates.
    """

    pools: DevicePools
    """The L1 pools: ``k(l)``, ``v(l)`` (plain / gated attention), ``k(l)`` (MLA latent) and
    ``indexer(l)`` (lightning-indexer keys) of this rank's layers."""
    pages: list[int]
    """Device page ids in token order."""


@dataclass(kw_only=True, slots=True)
class SeqState:
    """What a rank's layers carry between calls for one sequence. Mutable.

    ``HybridModel.prefill``/``decode`` replace the tensors of the local layers (never
    modify them in place) and advance ``num_tokens``. Built by ``HybridModel.new_state()``
    (empty) or by the engine from cached pages (a prefix of ``num_tokens`` tokens).
    Shapes are this rank's shards (local heads / channels), on the model's device.

    With ``pages`` set (``HybridModel.paged_state``) the attention state of the first
    ``num_tokens`` tokens is in the pool pages and new tokens' rows are written there;
    ``k``/``v``/``latent``/``index_k`` stay empty. The recurrent ``conv``/``ssm`` are always
    held here (fixed size).
    """

    num_tokens: int = 0
    """Tokens already processed: the position of the next token."""
    k: dict[int, Tensor] = field(default_factory=dict)
    """Per local attention layer: ``[t_local, local_kv_heads, head_dim]`` (model dtype).
    ``cp_kv="replicate"``: all ``num_tokens`` tokens. ``"shard"``: only this cp rank's
    tokens (``kv_shard_positions``), in position order."""
    v: dict[int, Tensor] = field(default_factory=dict)
    """Like ``k``."""
    conv: dict[int, Tensor] = field(default_factory=dict)
    """Per local SSM layer: the last ``conv_kernel - 1`` conv inputs ``[local_conv_dim, K-1]``
    (oldest first; zeros before the sequence start). Model dtype."""
    ssm: dict[int, Tensor] = field(default_factory=dict)
    """Per local SSM layer: ``[local_ssm_heads, ssm_head_dim, ssm_state_dim]`` float32."""
    latent: dict[int, Tensor] = field(default_factory=dict)
    """Per local MLA layer: ``[t_local, kv_lora_rank + qk_rope_head_dim]`` (model dtype): the
    compressed (normed) latent KV then the roped decoupled key, the same on every tp rank.
    Which tokens: like ``k``."""
    index_k: dict[int, Tensor] = field(default_factory=dict)
    """Per local lightning-indexer layer: ``[t_local, index_head_dim]`` (model dtype), the same
    on every tp rank. Which tokens: like ``k``."""

    pages: PageTable | None = None
    """None: contiguous attention state (the dicts above). Set: paged (see above)."""

    def clone(self) -> SeqState:
        """A copy that shares no tensors with this state (a paged state's copy shares its
        page table: the pages are the pool's, not the state's)."""
        return SeqState(
            num_tokens=self.num_tokens,
            pages=self.pages,
            k={i: t.clone() for i, t in self.k.items()},
            v={i: t.clone() for i, t in self.v.items()},
            conv={i: t.clone() for i, t in self.conv.items()},
            ssm={i: t.clone() for i, t in self.ssm.items()},
            latent={i: t.clone() for i, t in self.latent.items()},
            index_k={i: t.clone() for i, t in self.index_k.items()},
        )
