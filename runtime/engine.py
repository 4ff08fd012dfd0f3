"""The serving engine: match -> load -> prefill the suffix -> insert -> decode -> insert.

One request at a time (the cache API does not assume it). Every rank of the mesh runs
the same requests in the same order: the model and the cache are collective.

Per-token hook: ``serve(..., on_token=f)`` calls ``f(token_id)`` after each generated
token; a true result ends the request after that token (e.g. at end of sequence), and an
exception leaves it (the request is released). On a mesh ``f`` must decide the same on
every rank (the caller agrees on it, e.g. by a broadcast from rank 0).

Paging: the model keeps a request's state contiguous (``SeqState``); the engine moves
it between the cache's device pools and that state. A page of layer L in the device
pool is ``[page_size_local, kv_heads_local, head_dim]``; with ``cp_kv="shard"`` cp rank
c keeps in-page offsets ``[c * page_size_local, (c + 1) * page_size_local)``. An MLA
layer's latent ``[t, D]`` is the keys-only KV of one head (``KVSpec.values=False``) and
its indexer keys ``[t, E]`` the ``indexer`` pages of that layer; both page like K.

Mamba checkpoints: the state is written to a device slot at the last page boundary of
the prompt (only when decoding will not reach a page boundary), at the point where the
prompt branched off a cached KV path that had no state there (so the next request with
that prefix gets a hit), and at the last page boundary reached while decoding (for the
next turn of a chat).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from mesh_hicache.cache import CachedRequest, CacheFull, HiCache
from mesh_hicache.layout import kv_page_tokens, kv_shard_positions
from runtime.model import HybridModel, SeqState
from runtime.workloads import Turn

TokenHook = Callable[[int], bool]
"""Called with each generated token id; True ends the request after that token."""


def stop_at(token_id: int) -> TokenHook:
    """The hook that ends a request after ``token_id`` (e.g. end of sequence)."""
    return lambda token: token == token_id


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


class TierTokens(NamedTuple):
    """Prompt tokens a request reused, by the tier they came from."""

    device: int
    host: int
    storage: int


NO_HIT = TierTokens(0, 0, 0)


class PagedRequest(NamedTuple):
    """A request whose KV lives in device pages: its cache handle and its page ids
    (the cached prefix's pages, then the ones allocated for the rest)."""

    req: CachedRequest
    pages: list[int]


@dataclass(slots=True)
class _Checkpoint:
    """A Mamba state written to a device slot after ``num_tokens`` tokens."""

    num_tokens: int
    slot: int


@dataclass(slots=True)
class Engine:
    """Runs requests through ``model`` with ``cache`` (None = recompute everything)."""

    model: HybridModel
    cache: HiCache | None
    max_new_tokens: int = 8
    keep_logits: bool = False
    histories: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def run(
        self, trace: Sequence[Turn], progress: Callable[[RequestResult], None] | None = None
    ) -> list[RequestResult]:
        """Serve a whole trace; each turn's prompt is its session's history + user tokens.
        A turn with a ``stop_token`` ends after it (every rank sees the same greedy
        tokens, so every rank stops at the same one)."""
        results = []
        for turn in trace:
            prompt = self.histories.get(turn.session, []) + list(turn.user_tokens)
            result = self.serve(
                prompt,
                turn.namespace,
                max_new_tokens=turn.max_new_tokens,
                tenant=turn.tenant,
                on_token=None if turn.stop_token is None else stop_at(turn.stop_token),
            )
            result.request_id, result.session, result.turn = (
                turn.request_id,
                turn.session,
                turn.turn,
            )
            self.histories[turn.session] = prompt + result.output_ids
            results.append(result)
            if progress is not None:
                progress(result)
        return results

    def serve(
        self,
        prompt: Sequence[int],
        namespace: str = "",
        *,
        max_new_tokens: int | None = None,
        tenant: str | None = None,
        on_token: TokenHook | None = None,
    ) -> RequestResult:
        """Greedy-generate up to ``max_new_tokens`` (default: the engine's) after
        ``prompt`` (at least 1 token). Without ``on_token`` exactly that many tokens; with
        it, ``on_token(id)`` is called after each generated token and a true result stops
        there (that token is the last of ``output_ids``; no decode step is spent after
        it). ``tenant``: the request's cache tenant (None: the cache's; see
        ``HiCache.match``)."""
        if not prompt:
            raise ValueError("prompt must not be empty")
        num_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if num_new < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {num_new}")
        t0 = time.perf_counter()
        tokens = torch.tensor(list(prompt), dtype=torch.long)
        if self.cache is None:
            state = self.model.new_state()
            logits = self.model.prefill(tokens, state)
            ttft = time.perf_counter() - t0
            return self._decode(prompt, state, logits, ttft, None, NO_HIT, num_new, on_token)
        cache = self.cache
        # Match one token short: at least one prompt token is always computed, and its
        # logits start the decode.
        req = cache.match(prompt[:-1], namespace, tenant=tenant)
        try:
            return self._serve_cached(prompt, tokens, req, t0, num_new, on_token)
        finally:
            cache.release(req)

    # -- the cached path --------------------------------------------------------------------

    def _serve_cached(
        self,
        prompt: Sequence[int],
        tokens: torch.Tensor,
        req: CachedRequest,
        t0: float,
        num_new: int,
        on_token: TokenHook | None,
    ) -> RequestResult:
        cache, model, ps = self.cache, self.model, self.model.page_size
        assert cache is not None
        cache.load(req)
        state = self._state_from_cache(req)
        prefix = cache.finish_load(req)
        if prefix == 0:
            state = model.new_state()
        hit, served = req.hit, req.served
        cached = TierTokens(int(served[0]), int(served[1]), int(served[2]))
        total_pages = -(-(len(prompt) + num_new) // ps)
        pages: list[int] | None = None
        try:
            new = cache.alloc_pages(req, total_pages - prefix // ps)
            pages = req.prefix_pages[: prefix // ps] + new
        except CacheFull:
            pass  # Longer than L1 can hold (agreed on every rank): serve it uncached.
        # Checkpoints inside the prompt: where it branched off a stateless KV path, and the
        # last page boundary. Prefill is split there so the state can be captured.
        # Admission (docs/DESIGN.md section 9): the prompt-end ones only when decode will
        # not reach a page boundary (with a hook it may stop early: keep them).
        n_prompt = len(prompt)
        decode_cp = on_token is None and (n_prompt + num_new - 1) // ps > n_prompt // ps
        stops = set()
        if cache.spec.has_mamba:
            if prefix < hit.raw_kv_tokens < len(prompt):
                stops.add(hit.raw_kv_tokens)
            if not decode_cp:
                # Strictly inside the prompt: a repeat of this prompt matches one token short.
                stops.add((len(prompt) - 1) // ps * ps)
        stops = {s for s in stops if prefix < s <= len(prompt)} | {len(prompt)}
        checkpoints: list[_Checkpoint] = []
        pos = prefix
        logits = torch.empty(0)
        for stop in sorted(stops):
            logits = model.prefill(tokens[pos:stop], state)
            pos = stop
            end_cp = decode_cp and stop == n_prompt
            if stop % ps == 0 and cache.spec.has_mamba and pages is not None and not end_cp:
                checkpoint = self._checkpoint(req, state)
                if checkpoint is not None:
                    checkpoints.append(checkpoint)
        ttft = time.perf_counter() - t0
        if pages is None:
            return self._decode(prompt, state, logits, ttft, None, cached, num_new, on_token)
        self._write_kv(state, pages, prefix, len(prompt))
        for cp in checkpoints:
            cache.insert(req, prompt[: cp.num_tokens], pages[: cp.num_tokens // ps], cp.slot)
        if not cache.spec.has_mamba and len(prompt) >= ps:
            n = len(prompt) // ps * ps
            cache.insert(req, prompt[:n], pages[: n // ps])
        paged = PagedRequest(req, pages)
        return self._decode(prompt, state, logits, ttft, paged, cached, num_new, on_token)

    def _state_from_cache(self, req: CachedRequest) -> SeqState:
        """The model state after ``req.prefix_len`` cached tokens, layer by layer."""
        assert self.cache is not None
        model, pools = self.model, self.cache.device
        state = model.new_state()
        n = req.prefix_len
        if n == 0:
            return state
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
                state.ssm[layer] = pools.ssm(layer)[req.mamba_slot].clone()
        state.num_tokens = n
        return state

    def _checkpoint(self, req: CachedRequest, state: SeqState) -> _Checkpoint | None:
        """Write the state to a new device slot; None when every slot is in use."""
        assert self.cache is not None
        try:
            slot = self.cache.alloc_slot(req)
        except CacheFull:
            return None
        self._write_state(state, slot)
        return _Checkpoint(state.num_tokens, slot)

    def _write_state(self, state: SeqState, slot: int) -> None:
        assert self.cache is not None
        pools = self.cache.device
        for layer, conv in state.conv.items():
            pools.conv(layer)[slot] = conv
            pools.ssm(layer)[slot] = state.ssm[layer]

    def _write_kv(self, state: SeqState, pages: list[int], start: int, end: int) -> None:
        """Copy the K/V (MLA: latent and indexer keys) of positions ``[start, end)`` from
        ``state`` into their pages (this cp rank's rows of them under ``cp_kv="shard"``)."""
        assert self.cache is not None
        model, pools, ps = self.model, self.cache.device, self.model.page_size
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
        page_ids = torch.tensor(pages, dtype=torch.long)[pos // ps]
        in_page = pos % ps - offset
        for layer in state.k:
            pools.k(layer)[page_ids, in_page] = state.k[layer][local]
            pools.v(layer)[page_ids, in_page] = state.v[layer][local]
        for layer, latent in state.latent.items():
            pools.k(layer)[page_ids, in_page] = latent[local].unsqueeze(1)
        for layer, keys in state.index_k.items():
            pools.indexer(layer)[page_ids, in_page] = keys[local]

    # -- decode -----------------------------------------------------------------------------

    def _decode(
        self,
        prompt: Sequence[int],
        state: SeqState,
        logits: torch.Tensor,
        ttft: float,
        paged: PagedRequest | None,
        cached: TierTokens,
        num_new: int,
        on_token: TokenHook | None,
    ) -> RequestResult:
        t0 = time.perf_counter()
        ps = self.model.page_size
        first_logits = logits
        output: list[int] = []
        boundary: _Checkpoint | None = None
        for i in range(num_new):
            token = int(torch.argmax(logits))
            output.append(token)
            stop = on_token is not None and on_token(token)
            if stop or i == num_new - 1:
                break
            logits = self.model.decode(token, state)
            if paged is not None and self.cache is not None and state.num_tokens % ps == 0:
                if self.cache.spec.has_mamba:
                    if boundary is None:
                        boundary = self._checkpoint(paged.req, state)
                    else:
                        self._write_state(state, boundary.slot)
                        boundary.num_tokens = state.num_tokens
        if paged is not None and self.cache is not None:
            req, pages = paged
            self._write_kv(state, pages, len(prompt), state.num_tokens)
            full = list(prompt) + output
            if boundary is not None:
                n = boundary.num_tokens
                self.cache.insert(req, full[:n], pages[: n // ps], boundary.slot)
            elif not self.cache.spec.has_mamba and state.num_tokens >= ps:
                n = state.num_tokens // ps * ps
                self.cache.insert(req, full[:n], pages[: n // ps])
        return RequestResult(
            request_id=0,
            session=0,
            turn=0,
            prompt_len=len(prompt),
            cached_device=cached.device,
            cached_host=cached.host,
            cached_storage=cached.storage,
            ttft_s=ttft,
            decode_s=time.perf_counter() - t0,
            output_ids=output,
            last_logits=first_logits.tolist() if self.keep_logits else None,
        )
