"""SeqState: one request's model state on one rank; its attention state either contiguous
(in the state's own tensors) or paged (in the L1 device pools, through a :class:`PageTable`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from runtime.model.parallel import AxisComm, kv_shard_positions

if TYPE_CHECKING:
    from mesh_hicache.pools.device import DevicePools

ROW_FIELDS = ("k", "v", "latent", "index_k")
"""The per-token attention fields of a :class:`SeqState` (contiguous) / pool (paged)."""


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


class AttentionRows:
    """Where an attention layer's per-token rows live: the one place that knows paging.

    Every attention kind stores its per-token tensors (``field`` in :data:`ROW_FIELDS`)
    through this: contiguous in ``state.<field>[layer]`` or paged in the pool page of each
    token (``k``/``v``: ``pools.k/v(layer)`` ``[P, T, G, E]``; ``latent``: ``pools.k(layer)``
    with its one head-less "head"; ``index_k``: ``pools.indexer(layer)``), T = this rank's
    in-page rows (``page_size / cp`` under ``cp_kv="shard"``, cp rank c keeping the in-page
    offsets ``[c*T, (c+1)*T)``). Which tokens a rank keeps: all under ``replicate`` (or
    cp = 1); its ``kv_shard_positions`` under ``shard``.
    """

    __slots__ = ("page_size", "cp_kv")

    def __init__(self, page_size: int, cp_kv: str) -> None:
        self.page_size = page_size
        self.cp_kv = cp_kv

    def sharded(self, cp: AxisComm) -> bool:
        """Whether this rank keeps only its own tokens (``shard`` with cp > 1)."""
        return self.cp_kv == "shard" and cp.size > 1

    def num_kept(self, num_tokens: int, cp: AxisComm, rank: int | None = None) -> int:
        """How many of the first ``num_tokens`` tokens cp ``rank`` (default: this one) keeps."""
        if not self.sharded(cp):
            return num_tokens
        rank = cp.rank if rank is None else rank
        ps, per = self.page_size, self.page_size // cp.size
        full, rest = divmod(num_tokens, ps)
        return full * per + min(max(rest - rank * per, 0), per)

    def read(self, state: SeqState, name: str, layer: int, num_tokens: int, cp: AxisComm) -> Tensor:
        """This rank's rows of the first ``num_tokens`` tokens, in position order
        ``[n_kept, *row]`` (contiguous: the state's own tensor; paged: a view of the pool
        when the pages are one run of ids, else gathered from the pages, a transient copy).
        Read only: never modify the result in place."""
        count = self.num_kept(num_tokens, cp)
        table = state.pages
        if table is None:
            rows = getattr(state, name)[layer]
            assert rows.shape[0] == count, (name, layer, rows.shape, count)
            return rows
        pool = _pool(table, name, layer)
        n_pages = -(-count // pool.shape[1])
        assert n_pages <= len(table.pages), (num_tokens, len(table.pages))
        pages = table.pages[:n_pages]
        first = pages[0] if pages else 0
        if pages == list(range(first, first + n_pages)):
            # One run of page ids (the allocator hands out the lowest free ones): a view of
            # the pool itself where its pages are contiguous, no gather.
            return pool[first : first + n_pages].flatten(0, 1)[:count]
        ids = torch.tensor(pages, dtype=torch.long, device=pool.device)
        return pool[ids].flatten(0, 1)[:count]

    def read_range(self, state: SeqState, name: str, layer: int, start: int, end: int) -> Tensor:
        """The rows of tokens ``start .. end - 1`` ``[end - start, *row]`` of a rank that keeps
        every token (not ``shard`` with cp > 1): only the pages holding them are read (a
        view where they are one run of page ids). Read only."""
        table = state.pages
        if table is None:
            return getattr(state, name)[layer][start:end]
        pool = _pool(table, name, layer)
        ps = pool.shape[1]
        p0, p1 = start // ps, -(-end // ps)
        assert p1 <= len(table.pages), (end, len(table.pages))
        pages = table.pages[p0:p1]
        first = pages[0] if pages else 0
        if pages == list(range(first, first + len(pages))):
            block = pool[first : first + len(pages)]
        else:
            block = pool[torch.tensor(pages, dtype=torch.long, device=pool.device)]
        return block.flatten(0, 1)[start - p0 * ps : end - p0 * ps]

    def append(
        self, state: SeqState, name: str, layer: int, rows: Tensor, start: int, cp: AxisComm
    ) -> None:
        """Store the rows this rank keeps of ``rows`` ``[m, *row]``, the tokens at positions
        ``start .. start + m - 1`` (contiguous: appended to the state's tensor, which must
        hold exactly the tokens before ``start``; paged: written into their page slots)."""
        ps, table = self.page_size, state.pages
        positions = range(start, start + rows.shape[0])
        if self.sharded(cp):
            per = ps // cp.size
            kept = [i for i, p in enumerate(positions) if p % ps // per == cp.rank]
            if len(kept) < len(positions):
                rows = rows[torch.tensor(kept, dtype=torch.long, device=rows.device)]
            positions = [positions[i] for i in kept]  # type: ignore[assignment]
        if table is None:
            store = getattr(state, name)
            store[layer] = torch.cat([store[layer], rows])
            return
        if not len(positions):
            return
        if positions[-1] // ps >= len(table.pages):
            raise ValueError(
                f"the page table's {len(table.pages)} pages of {ps} tokens do not cover "
                f"position {positions[-1]}"
            )
        pool = _pool(table, name, layer)
        offset = cp.rank * pool.shape[1] if self.sharded(cp) else 0
        where = [(table.pages[p // ps], p % ps - offset) for p in positions]
        slots = torch.tensor(where, dtype=torch.long, device=pool.device)  # [m, (page, row)]
        pool[slots[:, 0], slots[:, 1]] = rows.to(pool.dtype)

    def extend(
        self, state: SeqState, name: str, layer: int, new: Tensor, start: int, cp: AxisComm
    ) -> Tensor:
        """Store ``new`` (rows of positions ``start..``, the same on every cp rank) like
        :meth:`append` and return every row of the first ``start + m`` tokens in position
        order (under ``shard``: rebuilt from every cp rank's rows, a collective)."""
        if not self.sharded(cp):
            self.append(state, name, layer, new, start, cp)
            return self.read(state, name, layer, start + new.shape[0], cp)
        old = self.gather(state, name, layer, start, cp)
        self.append(state, name, layer, new, start, cp)
        return torch.cat([old, new])

    def gather(
        self, state: SeqState, name: str, layer: int, num_tokens: int, cp: AxisComm
    ) -> Tensor:
        """Every row of the first ``num_tokens`` tokens in position order, from every cp
        rank's kept rows under ``shard`` (collective; every rank passes the same count)."""
        local = self.read(state, name, layer, num_tokens, cp)
        if not self.sharded(cp):
            return local
        owned = [kv_shard_positions(num_tokens, self.page_size, cp.size, r) for r in range(cp.size)]
        parts = cp.all_gather_ragged(local, [len(p) for p in owned])
        full = local.new_empty((num_tokens, *local.shape[1:]))
        for positions, part in zip(owned, parts, strict=True):
            full[positions.to(full.device)] = part
        return full

    def gather_batch(
        self, states: list[SeqState], names: tuple[str, ...], layer: int, cp: AxisComm
    ) -> list[list[Tensor]]:
        """:meth:`gather` of every ``names`` field of every state's first ``num_tokens``
        tokens, in ONE collective for the batch under ``shard`` (the fields' rows are packed
        side by side, the states one after another). Returns ``[state][name]`` tensors."""
        local = [[self.read(s, n, layer, s.num_tokens, cp) for n in names] for s in states]
        if not self.sharded(cp):
            return local
        shapes = [t.shape[1:] for t in local[0]]
        widths = [math.prod(shape) for shape in shapes]
        packed = torch.cat([torch.cat([t.flatten(1) for t in rows], dim=1) for rows in local])
        counts = [[self.num_kept(s.num_tokens, cp, r) for s in states] for r in range(cp.size)]
        parts = cp.all_gather_ragged(packed, [sum(c) for c in counts])
        full = [packed.new_empty((s.num_tokens, packed.shape[1])) for s in states]
        for r, part in enumerate(parts):
            for i, piece in enumerate(part.split(counts[r])):
                n = states[i].num_tokens
                positions = kv_shard_positions(n, self.page_size, cp.size, r)
                full[i][positions.to(packed.device)] = piece
        return [
            [f.reshape(-1, *shape) for f, shape in zip(rows.split(widths, 1), shapes, strict=True)]
            for rows in full
        ]


@dataclass(frozen=True, slots=True)
class DecodeSlots:
    """Where one batched decode step's paged K/V rows are (the same for every attention
    layer of the step): the new token of sequence b goes to
    ``pool[write_pages[b], write_rows[b]]``; its keys are ``pool[read_pages[b, l],
    read_rows[b, l]]`` for ``l < num_tokens + 1``, the rest of the row padding
    (``hidden[b, l]`` True)."""

    write_pages: Tensor
    write_rows: Tensor
    read_pages: Tensor
    read_rows: Tensor
    hidden: Tensor


BATCH_ROWS_LIMIT = 1 << 18
"""Most padded K rows x row elements (B x L x heads x head dim) a batched paged decode
gathers per layer; larger batches attend per sequence (views of the pool, no copy).
Measured on one core, 4 sequences of about 620 tokens: Llama hidden 128 (64 per row,
160K) 2.95 ms a step batched vs 3.3-3.4 per sequence; Llama hidden 1024 (640K) 69 ms vs
61-62 ms: there copying the keys costs more than the per-sequence calls."""

_slots_cache: tuple[object, DecodeSlots | None] = (None, None)


def decode_slots(
    states: Sequence[SeqState], page_size: int, row_numel: int, device: torch.device
) -> DecodeSlots | None:
    """:class:`DecodeSlots` of a decode step over ``states`` when every one is paged on the
    same pools and keeps every token (not ``shard`` with cp > 1: the caller checks), and
    the padded gather stays under :data:`BATCH_ROWS_LIMIT`; else None. Built once per step
    (the step's layers share it: a one-entry cache keyed by what it is computed from:
    the lengths, the pages and the page size)."""
    if len(states) < 2 or any(s.pages is None for s in states):
        return None
    pools = states[0].pages.pools  # type: ignore[union-attr]
    if any(s.pages.pools is not pools for s in states):  # type: ignore[union-attr]
        return None
    lengths = [s.num_tokens + 1 for s in states]
    width = max(lengths)
    if len(states) * width * row_numel > BATCH_ROWS_LIMIT:
        return None
    tables = []
    for s, n in zip(states, lengths, strict=True):
        pages = s.pages.pages  # type: ignore[union-attr]
        need = -(-n // page_size)
        if need > len(pages):
            raise ValueError(
                f"the page table's {len(pages)} pages of {page_size} tokens do not cover "
                f"position {n - 1}"
            )
        tables.append(tuple(pages[:need]))
    key = (str(device), page_size, tuple(lengths), tuple(tables))
    global _slots_cache
    cached_key, cached = _slots_cache  # one read: another thread may replace the pair
    if cached_key == key:
        return cached
    wide = -(-width // page_size)
    table = torch.tensor([list(t) + [t[0]] * (wide - len(t)) for t in tables], dtype=torch.long)
    offsets = torch.arange(width)
    read_pages = table.repeat_interleave(page_size, dim=1)[:, :width]
    read_rows = (offsets % page_size).expand(len(states), width)
    hidden = offsets[None, :] >= torch.tensor(lengths)[:, None]
    pos = torch.tensor(lengths) - 1
    write_pages = table.gather(1, (pos // page_size)[:, None]).flatten()
    parts = (write_pages, pos % page_size, read_pages, read_rows, hidden)
    slots = DecodeSlots(*(t.to(device) for t in parts))
    _slots_cache = (key, slots)
    return slots


def _pool(table: PageTable, name: str, layer: int) -> Tensor:
    # [P, T, *row] view of the pool holding ``name`` rows of ``layer`` (writes go to it).
    if name == "k":
        return table.pools.k(layer)
    if name == "v":
        return table.pools.v(layer)
    if name == "latent":  # keys-only KV of one head-less "head": [P, T, 1, D] -> [P, T, D]
        return table.pools.k(layer).select(2, 0)
    assert name == "index_k", name
    return table.pools.indexer(layer)
