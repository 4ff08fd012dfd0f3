"""SeqState: one request's model state on one rank, contiguous (the engine pages it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass(kw_only=True, slots=True)
class SeqState:
    """What a rank's layers carry between calls for one sequence. Mutable.

    ``HybridModel.prefill``/``decode`` replace the tensors of the local layers (never
    modify them in place) and advance ``num_tokens``. Built by ``HybridModel.new_state()``
    (empty) or by the engine from cached pages (a prefix of ``num_tokens`` tokens).
    Shapes are this rank's shards (local heads / channels), on the model's device.
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

    def clone(self) -> SeqState:
        """A copy that shares no tensors with this state."""
        return SeqState(
            num_tokens=self.num_tokens,
            k={i: t.clone() for i, t in self.k.items()},
            v={i: t.clone() for i, t in self.v.items()},
            conv={i: t.clone() for i, t in self.conv.items()},
            ssm={i: t.clone() for i, t in self.ssm.items()},
            latent={i: t.clone() for i, t in self.latent.items()},
            index_k={i: t.clone() for i, t in self.index_k.items()},
        )
