"""HybridModel: the hybrid decoder, split over a ``pp x cp x tp`` mesh.

Every rank builds the layers of its pp stage from a :class:`WeightSource` (seeded random
weights for the presets, a checkpoint's tensors for real models), reading only its tp
shard, and runs the same code; communication is only through the tp / cp / pp groups of
the ``MeshTopology``. A :class:`SeqState` is contiguous (``new_state``: the model appends
to the state's own tensors) or paged (``paged_state``: attention reads and writes the L1
pool pages of the request's page table; the caller allocates the pages).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from mesh_hicache.layout import StateLayout, tp_split
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.spec import StateSpec
from mesh_hicache.topology import MeshTopology
from runtime.model.config import ATTENTION, MLP, PARALLEL, SSM, ModelConfig
from runtime.model.ffn import DenseMLP, MoE
from runtime.model.gated_attention import GatedAttention, GatedSharedMoE
from runtime.model.gdn import GatedDeltaNet
from runtime.model.layers import Attention, Mamba2, RMSNorm
from runtime.model.mamba1 import Mamba1
from runtime.model.mla import MLAttention
from runtime.model.parallel import AxisComm, MeshComms, cp_chunk_bounds, stage_layer_range
from runtime.model.parallel_mixer import ParallelMixer
from runtime.model.shortconv import ShortConv
from runtime.model.state import PageTable, SeqState
from runtime.model.weights import SeededWeights, WeightSource
from runtime.model.windowed import WindowedAttention

RECURRENT_MIXERS = (Mamba2, GatedDeltaNet, Mamba1, ShortConv)


def norm_weight(weights: WeightSource, name: str, config: ModelConfig) -> Tensor:
    """A residual-stream RMSNorm weight plus ``config.norm_offset`` (``(1 + w)`` norms)."""
    w = weights.get(name)
    if config.norm_offset:
        w = w.float() + config.norm_offset
    return w.to(config.dtype)


class Layer:
    """One cache layer: its mixer block and the feed-forward blocks that go with it.

    Every block is pre-norm residual: ``h += residual_scale * op(norm(h))``. ``norm1`` /
    ``mixer`` are the mixer block's norm and op; ``mixers`` the state-carrying ops (the
    mixer, or a parallel layer's attention and recurrent mixer).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        weights: WeightSource,
        tp: AxisComm,
        cp_kv: str,
        page_size: int,
    ) -> None:
        self.layer_id = layer_id
        self.scale = config.residual_scale
        self.blocks: list[tuple[RMSNorm, object]] = []
        self.post_norms: list[RMSNorm | None] = []
        self.mixer: (
            Attention | MLAttention | Mamba2 | GatedDeltaNet | Mamba1 | ShortConv | ParallelMixer
        )
        self.mixers: tuple[object, ...] = ()
        kinds: dict[str, type[Attention] | type[MLAttention]] = {
            "plain": Attention,
            "gated": GatedAttention,
            "mla": MLAttention,
            "windowed": WindowedAttention,
        }
        attention = kinds[config.attn_kind]
        recurrents: dict[
            str, type[Mamba2] | type[GatedDeltaNet] | type[Mamba1] | type[ShortConv]
        ] = {
            "mamba2": Mamba2,
            "gdn": GatedDeltaNet,
            "mamba1": Mamba1,
            "shortconv": ShortConv,
        }
        recurrent = recurrents[config.ssm_kind]
        moe = GatedSharedMoE if config.shared_expert_gate else MoE
        for b in config.layer_blocks()[layer_id]:
            kind, prefix = config.blocks[b], f"blocks.{b}"
            norm = RMSNorm(norm_weight(weights, f"{prefix}.norm", config), config.norm_eps)
            op: object
            if kind == ATTENTION:
                op = self.mixer = attention(
                    config, prefix, layer_id, weights, tp, cp_kv=cp_kv, page_size=page_size
                )
                self.norm1 = norm
            elif kind == SSM:
                op = self.mixer = recurrent(config, prefix, layer_id, weights, tp)
                self.norm1 = norm
            elif kind == PARALLEL:  # config: plain attention and Mamba-2
                attn = Attention(
                    config,
                    f"{prefix}.attn",
                    layer_id,
                    weights,
                    tp,
                    cp_kv=cp_kv,
                    page_size=page_size,
                )
                ssm = Mamba2(config, f"{prefix}.ssm", layer_id, weights, tp)
                op = self.mixer = ParallelMixer(attn, ssm)
                self.norm1 = norm
            elif kind == MLP:
                op = DenseMLP(config, prefix, weights, tp)
            else:
                op = moe(config, prefix, weights, tp)
            self.blocks.append((norm, op))
            post = None
            if config.sandwich_norm:
                weight = norm_weight(weights, f"{prefix}.post_norm", config)
                post = RMSNorm(weight, config.norm_eps)
            self.post_norms.append(post)
        mixer = self.mixer
        self.mixers = (
            (mixer.attention, mixer.recurrent) if isinstance(mixer, ParallelMixer) else (mixer,)
        )

    def to(self, device: torch.device) -> None:
        for norm, op in self.blocks:
            norm.weight = norm.weight.to(device)
            op.to(device)  # type: ignore[attr-defined]
        for post in self.post_norms:
            if post is not None:
                post.weight = post.weight.to(device)

    def _add(self, h: Tensor, out: Tensor, post: RMSNorm | None) -> Tensor:
        if post is not None:
            out = post(out)
        return h + out * self.scale if self.scale != 1.0 else h + out

    def prefill(
        self, h: Tensor, bounds: list[tuple[int, int]], state: SeqState, comms: MeshComms
    ) -> Tensor:
        for (norm, op), post in zip(self.blocks, self.post_norms, strict=True):
            x = norm(h)
            if isinstance(op, (Attention, MLAttention, ParallelMixer)):
                h = self._add(h, op.prefill(x, bounds, state, comms.cp, comms.tp), post)
            elif isinstance(op, RECURRENT_MIXERS):
                h = self._add(h, op.forward(x, bounds, state, comms.cp, comms.tp), post)
            else:
                h = self._add(h, op(x, comms.tp), post)  # type: ignore[operator]
        return h

    def decode(self, h: Tensor, states: Sequence[SeqState], comms: MeshComms) -> Tensor:
        # h [B, D]: one token per state; every op runs the batch (one tp reduce each).
        for (norm, op), post in zip(self.blocks, self.post_norms, strict=True):
            x = norm(h)
            if isinstance(op, (Attention, MLAttention, ParallelMixer)):
                h = self._add(h, op.decode(x, states, comms.cp, comms.tp), post)
            elif isinstance(op, RECURRENT_MIXERS):
                # Every cp rank runs the same tokens: the recurrence needs no cp exchange.
                h = self._add(h, op.decode(x, states, comms.tp), post)
            else:
                h = self._add(h, op(x, comms.tp), post)  # type: ignore[operator]
        return h


class HybridModel:
    """The model on one rank of a mesh (or on one device with ``topology=None``).

    Construction is collective (creates the tp, cp, pp groups, in that order). Then every
    rank of the mesh must call :meth:`prefill` / :meth:`decode` with the same arguments:
    the collectives inside are unconditional.

    ``cp_kv``: ``"replicate"`` (every cp rank keeps every token's K/V) or ``"shard"``
    (cp rank c keeps the tokens whose position-in-page lies in ``[c*ps/cp, (c+1)*ps/cp)``
    with ``ps = page_size``; decode merges partial attention over cp by log-sum-exp).
    """

    def __init__(
        self,
        config: ModelConfig,
        topology: MeshTopology | None = None,
        *,
        cp_kv: str = "replicate",
        page_size: int = 16,
        weights: WeightSource | None = None,
    ) -> None:
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.config = config
        self.cp_kv = cp_kv
        self.page_size = page_size
        self.comms = MeshComms.from_topology(topology) if topology else MeshComms.solo()
        pp, cp, tp = self.comms.pp, self.comms.cp, self.comms.tp
        config.check_mesh(tp=tp.size, cp=cp.size, pp=pp.size, page_size=page_size, cp_kv=cp_kv)
        self.device = torch.device(topology.device_type if topology else "cpu")
        self.is_first_stage = pp.rank == 0
        self.is_last_stage = pp.rank == pp.size - 1
        # Global ids of this pp stage's layers (contiguous).
        self.local_layers: tuple[int, ...] = tuple(
            stage_layer_range(config.num_layers, pp.size, pp.rank)
        )
        c, dtype = config, config.dtype
        weights = weights if weights is not None else SeededWeights(config)
        # Which heads / groups / channels this rank keeps: the cache's layout says.
        with warnings.catch_warnings():  # the cache warns about its own knobs
            warnings.simplefilter("ignore")
            self.layout = StateLayout.for_coords(
                self.state_spec, (pp.size, cp.size, tp.size), (pp.rank, cp.rank, tp.rank), cp_kv
            )
        self.blocks = [Layer(c, i, weights, tp, cp_kv, page_size) for i in self.local_layers]
        for block in self.blocks:
            block.to(self.device)
        self.embed: Tensor | None = None
        if self.is_first_stage:
            self.embed = weights.get("embed").to(device=self.device, dtype=dtype)
        self.final_norm: RMSNorm | None = None
        self.lm_head: Tensor | None = None
        if self.is_last_stage:
            norm = norm_weight(weights, "final_norm", c).to(device=self.device)
            self.final_norm = RMSNorm(norm, c.norm_eps)
            # Split by vocab: gathering the logits is exact.
            rows = tp_split(c.vocab_size, tp.size, tp.rank)
            head = weights.get("lm_head", rows=(rows,))
            self.lm_head = head.to(device=self.device, dtype=dtype)

    # -- state --------------------------------------------------------------------------------

    @property
    def state_spec(self) -> StateSpec:
        """The cached state's spec at this model's page size (whole-model shapes)."""
        return self.config.state_spec(self.page_size)

    def new_state(self) -> SeqState:
        """An empty state (no tokens) for this rank's layers and shards."""
        c, state, layout = self.config, SeqState(), self.layout
        kv_heads = layout.local_kv_heads if c.attention_layers else 0
        for mixer in (m for block in self.blocks for m in block.mixers):
            if isinstance(mixer, MLAttention):
                lid = mixer.layer_id
                state.latent[lid] = torch.zeros(0, c.latent_dim, dtype=c.dtype, device=self.device)
                state.index_k[lid] = torch.zeros(
                    0, c.index_head_dim, dtype=c.dtype, device=self.device
                )
            elif isinstance(mixer, Attention):
                empty = torch.zeros(0, kv_heads, c.head_dim, dtype=c.dtype, device=self.device)
                state.k[mixer.layer_id], state.v[mixer.layer_id] = empty, empty.clone()
            else:
                assert isinstance(mixer, RECURRENT_MIXERS)
                channels = layout.local_conv_dim
                state.conv[mixer.layer_id] = torch.zeros(
                    channels, c.conv_kernel - 1, dtype=c.dtype, device=self.device
                )
                if c.ssm_kind != "shortconv":  # a short conv keeps its conv window only
                    state.ssm[mixer.layer_id] = torch.zeros(
                        layout.local_ssm_heads, c.ssm_head_dim, c.ssm_state_dim, device=self.device
                    )
        return state

    def paged_state(
        self, pools: DevicePools, pages: list[int], num_tokens: int = 0, *, slot: int | None = None
    ) -> SeqState:
        """A paged state (``SeqState.pages``) whose first ``num_tokens`` tokens are already in
        ``pages`` of ``pools`` (this rank's rows: see :class:`SeqState`); attention reads and
        writes the pages directly. ``pages`` must cover every token the model will write.
        ``slot``: the device Mamba slot holding the recurrent state after exactly
        ``num_tokens`` tokens, copied into ``conv``/``ssm`` (fixed size); required iff the
        model has recurrent layers and ``num_tokens > 0`` (``ValueError`` otherwise).
        """
        if not isinstance(pools, DevicePools):
            raise TypeError(f"pools must be DevicePools, got {type(pools).__name__}")
        pages = [int(p) for p in pages]
        if not isinstance(num_tokens, int) or not 0 <= num_tokens <= len(pages) * self.page_size:
            raise ValueError(
                f"num_tokens={num_tokens!r} must be in [0, {len(pages)} pages * {self.page_size}]"
            )
        if any(not 0 <= p < pools.num_pages for p in pages):
            raise ValueError(f"page ids must be in range({pools.num_pages}), got {pages}")
        recurrent = bool(self.config.ssm_layers)
        if (slot is not None) != (recurrent and num_tokens > 0):
            need = "needs" if recurrent and num_tokens > 0 else "takes no"
            raise ValueError(
                f"slot={slot!r}: a state of {num_tokens} tokens of this model {need} Mamba slot"
            )
        if slot is not None and not 0 <= slot < pools.num_slots:
            raise ValueError(f"slot={slot} must be in range({pools.num_slots})")
        layout, mine = pools.layout, self.layout
        if layout.page_size_local != mine.page_size_local:
            raise ValueError(
                f"the pools hold {layout.page_size_local} tokens of a page per rank, this "
                f"model {mine.page_size_local} (page size or cp_kv differ)"
            )
        state = self.new_state()
        for rows in (state.k, state.v, state.latent, state.index_k):
            rows.clear()
        state.pages = PageTable(pools, pages)
        state.num_tokens = num_tokens
        if slot is not None:
            for lid, conv in state.conv.items():
                state.conv[lid] = pools.conv(lid)[slot].to(conv.dtype).clone()
                if lid in state.ssm:
                    state.ssm[lid] = pools.ssm(lid)[slot].to(torch.float32).clone()
        return state

    # -- forward ------------------------------------------------------------------------------

    def prefill(self, tokens: Tensor, state: SeqState, *, all_logits: bool = False) -> Tensor:
        """Process ``tokens`` (int64 ``[T]``, T >= 1) after the ``state.num_tokens`` in ``state``.

        CP splits the tokens into contiguous chunks (:func:`cp_chunk_bounds`). Appends to
        ``state`` (see :class:`SeqState`) and advances ``num_tokens`` by T. Returns float32
        logits of the last position ``[vocab]`` (or of every position ``[T, vocab]`` with
        ``all_logits``), identical on every rank.
        """
        tokens = self._check_tokens(tokens)
        comms = self.comms
        bounds = cp_chunk_bounds(tokens.shape[0], comms.cp.size)
        start, end = bounds[comms.cp.rank]
        h = self._stage_input(tokens[start:end])
        for block in self.blocks:
            h = block.prefill(h, bounds, state, comms)
        logits = self._logits_buffer(tokens.shape[0] if all_logits else None)
        if self.is_last_stage:
            if all_logits:
                lengths = [e - s for s, e in bounds]
                hidden = torch.cat(comms.cp.all_gather_ragged(h, lengths))
                logits = self._logits(hidden)
            else:
                owner = next(c for c, (s, e) in enumerate(bounds) if s < tokens.shape[0] <= e)
                # Adding exact zeros from the other cp ranks moves the last hidden exactly.
                last = h[-1:] if comms.cp.rank == owner else h.new_zeros(1, h.shape[1])
                logits = self._logits(comms.cp.all_reduce(last))[0]
        else:
            self._send_next(h)
        state.num_tokens += tokens.shape[0]
        return comms.pp.broadcast(logits, src=comms.pp.size - 1)

    def decode(self, token: int, state: SeqState) -> Tensor:
        """Process one token at position ``state.num_tokens`` (the same on every cp rank).

        Appends to ``state`` and advances ``num_tokens`` by 1. Returns float32 ``[vocab]``
        logits, identical on every rank: ``decode_batch([token], [state])[0]``.
        """
        return self.decode_batch([token], [state])[0]

    def decode_batch(self, tokens: Sequence[int], states: Sequence[SeqState]) -> Tensor:
        """One token per state (``tokens[i]`` at position ``states[i].num_tokens``).

        Collective: every rank passes the same B >= 1 states in the same order (paged and
        contiguous may mix, each at its own length). The B rows go through every GEMM
        together (one tp reduce per block, one cp merge per attention layer, one pp send
        per stage, for the batch); attention runs per sequence over its own keys. Advances
        each ``num_tokens`` by 1. Returns float32 logits ``[B, vocab]``, identical on every
        rank. ``ValueError`` for B == 0, a length mismatch or a state passed twice.
        """
        if len(tokens) != len(states):
            raise ValueError(f"{len(tokens)} tokens for {len(states)} states")
        if not tokens:
            raise ValueError("decode_batch needs at least one (token, state)")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("decode_batch got the same state twice")
        ids = self._check_tokens(torch.tensor([int(t) for t in tokens], dtype=torch.long))
        h = self._stage_input(ids)
        for block in self.blocks:
            h = block.decode(h, states, self.comms)
        logits = self._logits_buffer(len(states))
        if self.is_last_stage:
            logits = self._logits(h)
        else:
            self._send_next(h)
        for state in states:
            state.num_tokens += 1
        return self.comms.pp.broadcast(logits, src=self.comms.pp.size - 1)

    # -- helpers ------------------------------------------------------------------------------

    def _check_tokens(self, tokens: Tensor) -> Tensor:
        if not isinstance(tokens, Tensor) or tokens.dim() != 1 or tokens.dtype != torch.long:
            raise TypeError(f"tokens must be a 1-D int64 tensor, got {tokens!r}")
        if tokens.numel() == 0:
            raise ValueError("tokens must not be empty")
        vocab = self.config.vocab_size
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
            raise ValueError(f"token ids must be in range({vocab}), got {tokens.tolist()}")
        return tokens.to(self.device)

    def _stage_input(self, tokens: Tensor) -> Tensor:
        # Stage 0 embeds; later stages receive the previous stage's activations. Both
        # sides know the chunk length, so an empty chunk is skipped on both.
        if self.embed is not None:
            h = self.embed[tokens]
            return h * self.config.embed_scale if self.config.embed_scale != 1.0 else h
        pp = self.comms.pp
        h = torch.empty(
            tokens.shape[0], self.config.d_model, dtype=self.config.dtype, device=self.device
        )
        if tokens.shape[0]:
            pp.recv(h, src=pp.rank - 1)
        return h

    def _send_next(self, h: Tensor) -> None:
        if h.shape[0]:
            self.comms.pp.send(h, dst=self.comms.pp.rank + 1)

    def _logits_buffer(self, num_positions: int | None) -> Tensor:
        vocab = self.config.vocab_size
        shape = (vocab,) if num_positions is None else (num_positions, vocab)
        return torch.empty(shape, dtype=torch.float32, device=self.device)

    def _logits(self, h: Tensor) -> Tensor:
        # [T, D] -> float32 [T, vocab]: each tp rank owns a vocab slice; gather them.
        assert self.final_norm is not None and self.lm_head is not None
        local = F.linear(self.final_norm(h), self.lm_head).float()
        if self.config.logits_scale != 1.0:
            local = local / self.config.logits_scale
        gathered = self.comms.tp.all_gather(local)  # [tp, T, V/tp]
        return gathered.permute(1, 0, 2).reshape(h.shape[0], -1).contiguous()
