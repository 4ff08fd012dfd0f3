"""One request's path through the model and the cache: :class:`RequestRun` (match ->
load -> prefill the suffix -> insert -> decode -> insert), driven step by step by
``runtime.engine.Engine`` (one request at a time) and ``runtime.scheduler`` (many at once),
and :class:`RequestResult`, what it produced.

Paging: a request that holds device pages runs on a paged state
(``HybridModel.paged_state``) when the model supports it: attention reads the cached
prefix and writes new tokens straight in the pool pages, so a device hit copies nothing
of the prefix. Otherwise (and for a request served uncached) the state is contiguous
(``SeqState``) and the engine copies between the pools and that state. A page of layer L
in the device pool is ``[page_size_local, kv_heads_local, head_dim]``; with
``cp_kv="shard"`` cp rank c keeps in-page offsets ``[c * page_size_local, (c + 1) *
page_size_local)``. An MLA layer's latent ``[t, D]`` is the keys-only KV of one head
(``KVSpec.values=False``) and its indexer keys ``[t, E]`` the ``indexer`` pages of that
layer; both page like K.

Mamba checkpoints: the state is written to a device slot at the last page boundary of
the prompt (only when decoding will not reach a page boundary), at the point where the
prompt branched off a cached KV path that had no state there (so the next request with
that prefix gets a hit), and at the last page boundary reached while decoding (for the
next turn of a chat).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mesh_hicache.cache import CachedRequest, CacheFull, HiCache
from mesh_hicache.layout import kv_page_tokens, kv_shard_positions
from runtime.model import HybridModel, SeqState
from runtime.sampling import Sampler


class EngineParts(Protocol):
    """What a request takes from the engine that runs it (``runtime.engine.Engine``)."""

    model: HybridModel
    cache: HiCache | None
    keep_logits: bool
    paged: bool


TokenHook = Callable[[int], bool]
"""Called with each generated token id; True ends the request after that token."""


def stop_at(*token_ids: int) -> TokenHook:
    """The hook that ends a request after any of ``token_ids`` (e.g. end of sequence)."""
    stops = frozenset(token_ids)
    return lambda token: token in stops


@dataclass(slots=True)
class RequestResult:
    """What one request produced and what the cache saved it."""

    request_id: int
    session: int
    turn: int
    prompt_len: int
    cached_device: int
    cached_host: int
    cached_storage: int
    ttft_s: float
    decode_s: float
    output_ids: list[int]
    last_logits: list[float] | None = None
    arrival_s: float = 0.0
    """Trace seconds at which the request arrived (agreed over the mesh when realtime)."""
    first_token_s: float = 0.0
    """Trace seconds at which its first token was produced."""
    finish_s: float = 0.0
    """Trace seconds at which its last token was produced."""

    @property
    def cached(self) -> int:
        return self.cached_device + self.cached_host + self.cached_storage

    def as_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "id": self.request_id,
            "session": self.session,
            "turn": self.turn,
            "prompt_len": self.prompt_len,
            "cached": {
                "device": self.cached_device,
                "host": self.cached_host,
                "storage": self.cached_storage,
            },
            "ttft_s": self.ttft_s,
            "decode_s": self.decode_s,
            "output_ids": self.output_ids,
            "arrival_s": self.arrival_s,
            "first_token_s": self.first_token_s,
            "finish_s": self.finish_s,
        }
        if self.last_logits is not None:
            out["last_logits"] = self.last_logits
        return out


@dataclass(slots=True)
class _Checkpoint:
    """A Mamba state written to a device slot after ``num_tokens`` tokens."""

    num_tokens: int
    slot: int


class RequestRun:
    """One request's steps, each collective (every rank calls the same ones in order)::

        run.match(); run.load(); run.finish_load()   # cache None: no-ops
        while not run.alloc(wait=...): ...           # pages, or uncached; False: try again
        while not run.prefilled: run.prefill_chunk(n)
        while not run.done: run.decoded(model.decode(run.next_token, run.state))
        result = run.finish()                        # the inserts after decode
        run.release()                                # always (also on errors)

    ``alloc`` places the Mamba checkpoints (docs/DESIGN.md section 9) and builds the state;
    the last prefill chunk inserts the prompt's pages and checkpoints, so requests that
    arrive meanwhile hit them; where the tree already held a page the request reads the
    tree's from then on (its own duplicate was freed by the insert).
    """

    def __init__(
        self,
        engine: EngineParts,
        prompt: Sequence[int],
        namespace: str,
        tenant: str | None,
        num_new: int,
        on_token: TokenHook | None,
        sampler: Sampler | None = None,
    ) -> None:
        if not prompt:
            raise ValueError("prompt must not be empty")
        if num_new < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {num_new}")
        self.model, self.cache, self.keep_logits = engine.model, engine.cache, engine.keep_logits
        self.use_paged = engine.paged
        self.prompt = list(prompt)
        self.tokens = torch.tensor(self.prompt, dtype=torch.long)
        self.namespace, self.tenant = namespace, tenant
        self.num_new, self.on_token = num_new, on_token
        self.sampler = sampler
        """Picks each token (``runtime.sampling``); None: greedy, ``argmax`` of the logits."""
        self.req: CachedRequest | None = None
        self.loaded = False
        self.prefix = 0
        self.pages: list[int] | None = None
        """Device pages of every token (prefix pages first); None: served uncached."""
        self.state: SeqState | None = None
        self.pos = 0
        self.stops: list[int] = []
        self.decode_cp = False
        self.checkpoints: list[_Checkpoint] = []
        self.boundary: _Checkpoint | None = None
        self.first_logits: torch.Tensor | None = None
        self.output: list[int] = []
        self.next_token: int | None = None
        """The token to decode next (None while prefilling and once done)."""
        self.done = False
        self.t_start = time.perf_counter()
        self.t_first = self.t_start

    # -- the cache steps ----------------------------------------------------------------------

    @property
    def has_storage_hit(self) -> bool:
        """An L3 prefetch is in flight (agreed: from the match result)."""
        return self.req is not None and self.req.hit.storage_tokens > 0

    @property
    def has_host_part(self) -> bool:
        """``load`` may copy host pages to device (agreed: from the match result)."""
        return self.req is not None and (self.req.hit.host_tokens + self.req.hit.storage_tokens) > 0

    @property
    def prefetch_done(self) -> bool:
        """This rank's L3 prefetch finished (rank-local: agree before acting on it)."""
        return self.req is None or self.req.prefetch_done

    def match(self) -> None:
        """Look the prompt up one token short: at least one prompt token is always
        computed, and its logits start the decode. Starts the L3 prefetch."""
        self.t_start = time.perf_counter()
        if self.cache is not None:
            self.req = self.cache.match(
                self.prompt, self.namespace, tenant=self.tenant, leave_one=True
            )

    def load(self) -> None:
        """Stop the prefetch (its policy) and start the host -> device load."""
        if self.req is not None:
            assert self.cache is not None
            self.cache.load(self.req)

    def finish_load(self) -> None:
        """Wait for the load (agreed); the prefix is final."""
        if self.req is not None:
            assert self.cache is not None
            self.prefix = self.cache.finish_load(self.req)
        self.loaded = True

    def alloc(self, *, wait: bool = False) -> bool:
        """Device pages for the prompt and ``num_new`` tokens, then the state. On
        ``CacheFull`` (agreed): False when ``wait`` (call again later), else the request
        is served uncached (no pages; longer than L1 can hold, or nothing will free any)."""
        assert self.loaded and self.state is None
        cache, req, ps = self.cache, self.req, self.model.page_size
        if cache is not None and req is not None:
            total_pages = -(-(len(self.prompt) + self.num_new) // ps)
            try:
                new = cache.alloc_pages(req, total_pages - self.prefix // ps)
                self.pages = req.prefix_pages[: self.prefix // ps] + new
            except CacheFull:
                if wait:
                    return False
        self._plan_checkpoints()
        self.state = self._initial_state()
        self.pos = self.prefix
        return True

    def _plan_checkpoints(self) -> None:
        # Checkpoints inside the prompt: where it branched off a stateless KV path, and the
        # last page boundary. Prefill is split there so the state can be captured.
        # Admission (docs/DESIGN.md section 9): the prompt-end ones only when decode will
        # not reach a page boundary (with a hook it may stop early: keep them).
        n, ps, prefix = len(self.prompt), self.model.page_size, self.prefix
        self.decode_cp = self.on_token is None and (n + self.num_new - 1) // ps > n // ps
        stops = set()
        if self.cache is not None and self.req is not None and self.cache.spec.has_mamba:
            raw = self.req.hit.raw_kv_tokens
            if prefix < raw < n:
                stops.add(raw)
            if not self.decode_cp:
                # Strictly inside the prompt: a repeat of this prompt matches one token short.
                stops.add((n - 1) // ps * ps)
        self.stops = sorted({s for s in stops if prefix < s <= n} | {n})

    @property
    def paged(self) -> bool:
        return self.state is not None and self.state.pages is not None

    def _initial_state(self) -> SeqState:
        model, req = self.model, self.req
        # A model without paged attention (a stand-in in tests, one that raises) gets the
        # contiguous copy below.
        paged_state = getattr(model, "paged_state", None)
        if self.pages is not None and self.cache is not None and self.use_paged and paged_state:
            assert req is not None
            slot = req.mamba_slot if self.prefix and self.cache.spec.has_mamba else None
            try:
                return paged_state(self.cache.device, self.pages, self.prefix, slot=slot)
            except NotImplementedError:
                pass
        if self.prefix == 0 or req is None:
            return model.new_state()
        return self._state_from_cache(req)

    def _state_from_cache(self, req: CachedRequest) -> SeqState:
        """A contiguous state after ``prefix`` cached tokens, copied out of the pools."""
        assert self.cache is not None
        model, pools, n = self.model, self.cache.device, self.prefix
        state = model.new_state()
        pages = torch.tensor(req.prefix_pages[: n // model.page_size], dtype=torch.long)
        for layer in model.local_layers:
            req.wait_layer(layer)
            if layer in state.latent:
                # The latent is the keys-only KV of one head-less "head": [pages, T, 1, D].
                dim = state.latent[layer].shape[1]
                state.latent[layer] = pools.k(layer)[pages].reshape(-1, dim).clone()
                if layer in state.index_k:
                    e = state.index_k[layer].shape[1]
                    state.index_k[layer] = pools.indexer(layer)[pages].reshape(-1, e).clone()
            elif layer in state.k:
                heads, dim = state.k[layer].shape[1:]
                state.k[layer] = pools.k(layer)[pages].reshape(-1, heads, dim).clone()
                state.v[layer] = pools.v(layer)[pages].reshape(-1, heads, dim).clone()
            else:
                assert req.mamba_slot is not None
                state.conv[layer] = pools.conv(layer)[req.mamba_slot].clone()
                if layer in state.ssm:  # a short conv keeps no recurrent state
                    state.ssm[layer] = pools.ssm(layer)[req.mamba_slot].clone()
        state.num_tokens = n
        return state

    # -- the model steps ----------------------------------------------------------------------

    @property
    def prefilled(self) -> bool:
        return self.first_logits is not None

    @property
    def remaining_prefill(self) -> int:
        return len(self.prompt) - self.pos

    def prefill_chunk(self, limit: int | None = None) -> int:
        """Prefill up to ``limit`` tokens (None: to the next checkpoint stop); returns the
        tokens computed. The last chunk inserts the prompt and takes the first token."""
        assert self.state is not None and not self.prefilled
        stop = next(s for s in self.stops if s > self.pos)
        end = stop if limit is None else min(stop, self.pos + max(1, limit))
        start, self.pos = self.pos, end
        logits = self.model.prefill(self.tokens[start:end], self.state)
        n, ps = len(self.prompt), self.model.page_size
        end_cp = self.decode_cp and end == n
        if end == stop and end % ps == 0 and self.pages is not None and not end_cp:
            if self.cache is not None and self.cache.spec.has_mamba:
                checkpoint = self._checkpoint()
                if checkpoint is not None:
                    self.checkpoints.append(checkpoint)
        if end == n:
            self.t_first = time.perf_counter()
            self.first_logits = logits
            self._insert_prompt()
            self._take(logits)
        return end - start

    def decoded(self, logits: torch.Tensor) -> None:
        """``logits`` of ``next_token`` (decoded into ``state``): checkpoint, next token."""
        assert self.state is not None and self.next_token is not None
        cache, state = self.cache, self.state
        if self.pages is not None and cache is not None and cache.spec.has_mamba:
            if state.num_tokens % self.model.page_size == 0:
                if self.boundary is None:
                    self.boundary = self._checkpoint()
                else:
                    self._write_state(self.boundary.slot)
                    self.boundary.num_tokens = state.num_tokens
        self._take(logits)

    def _take(self, logits: torch.Tensor) -> None:
        token = int(torch.argmax(logits)) if self.sampler is None else self.sampler.pick(logits)
        self.output.append(token)
        self.next_token = None
        stop = self.on_token is not None and self.on_token(token)
        if stop or len(self.output) == self.num_new:
            self.done = True
        else:
            self.next_token = token

    # -- inserts ------------------------------------------------------------------------------

    def _insert_prompt(self) -> None:
        if self.pages is None or self.cache is None or self.req is None:
            return
        cache, ps, prompt = self.cache, self.model.page_size, self.prompt
        if not self.paged:
            self._write_kv(self.prefix, len(prompt))
        for cp in self.checkpoints:
            self._insert(prompt[: cp.num_tokens], cp.slot)
        if not cache.spec.has_mamba and len(prompt) >= ps:
            self._insert(prompt[: len(prompt) // ps * ps])

    def _insert(self, tokens: list[int], slot: int | None = None) -> None:
        """Insert ``tokens`` (whole pages) with the request's pages for them. Where the
        tree already held a page (its duplicate here was freed), point the request at the
        tree's page: the same tokens' rows, and a paged state keeps reading them."""
        assert self.cache is not None and self.req is not None and self.pages is not None
        n = len(tokens) // self.model.page_size
        self.cache.insert(self.req, tokens, self.pages[:n], slot)
        held = self.req.held_pages[:n]
        assert len(held) == n, (len(held), n)
        for i, page in enumerate(held):
            if self.pages[i] != page:
                self.pages[i] = page
                if self.state is not None and self.state.pages is not None:
                    self.state.pages.pages[i] = page

    def finish(self) -> RequestResult:
        """Write and insert what decode added (and, paged, the prompt); the result."""
        assert self.done and self.state is not None and self.first_logits is not None
        cache, req, ps = self.cache, self.req, self.model.page_size
        if self.pages is not None and cache is not None and req is not None:
            if not self.paged:
                self._write_kv(len(self.prompt), self.state.num_tokens)
            full = self.prompt + self.output
            num_tokens = self.state.num_tokens
            if self.boundary is not None:
                self._insert(full[: self.boundary.num_tokens], self.boundary.slot)
            elif not cache.spec.has_mamba and num_tokens >= ps:
                self._insert(full[: num_tokens // ps * ps])
        served = req.served if req is not None else (0, 0, 0)
        now = time.perf_counter()
        return RequestResult(
            request_id=0,
            session=0,
            turn=0,
            prompt_len=len(self.prompt),
            cached_device=int(served[0]),
            cached_host=int(served[1]),
            cached_storage=int(served[2]),
            ttft_s=self.t_first - self.t_start,
            decode_s=now - self.t_first,
            output_ids=self.output,
            last_logits=self.first_logits.tolist() if self.keep_logits else None,
        )

    def release(self) -> None:
        """Unlock and free what the request still holds (idempotent; also on errors)."""
        if self.req is not None:
            assert self.cache is not None
            self.cache.release(self.req)

    # -- writes into the pools ----------------------------------------------------------------

    def _checkpoint(self) -> _Checkpoint | None:
        """Write the state to a new device slot; None when every slot is in use."""
        assert self.cache is not None and self.req is not None and self.state is not None
        try:
            slot = self.cache.alloc_slot(self.req)
        except CacheFull:
            return None
        self._write_state(slot)
        return _Checkpoint(self.state.num_tokens, slot)

    def _write_state(self, slot: int) -> None:
        assert self.cache is not None and self.state is not None
        pools, state = self.cache.device, self.state
        for layer, conv in state.conv.items():
            pools.conv(layer)[slot] = conv
            if layer in state.ssm:
                pools.ssm(layer)[slot] = state.ssm[layer]

    def _write_kv(self, start: int, end: int) -> None:
        """Copy the K/V (MLA: latent and indexer keys) of positions ``[start, end)`` from
        the contiguous state into their pages (this cp rank's rows of them under
        ``cp_kv="shard"``)."""
        assert self.cache is not None and self.pages is not None and self.state is not None
        model, pools, ps, state = self.model, self.cache.device, self.model.page_size, self.state
        cp = model.comms.cp
        # This rank's token range inside a page (all of it unless cp_kv="shard").
        offset, _ = kv_page_tokens(ps, cp.size, cp.rank, model.cp_kv)
        if model.cp_kv == "shard":
            positions = kv_shard_positions(end, ps, cp.size, cp.rank)
        else:
            positions = torch.arange(end)
        keep = positions >= start
        local = keep.nonzero().flatten()
        pos = positions[keep]
        page_ids = torch.tensor(self.pages, dtype=torch.long)[pos // ps]
        in_page = pos % ps - offset
        for layer in state.k:
            pools.k(layer)[page_ids, in_page] = state.k[layer][local]
            pools.v(layer)[page_ids, in_page] = state.v[layer][local]
        for layer, latent in state.latent.items():
            pools.k(layer)[page_ids, in_page] = latent[local].unsqueeze(1)
        for layer, keys in state.index_k.items():
            pools.indexer(layer)[page_ids, in_page] = keys[local]
