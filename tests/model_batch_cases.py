"""Scenarios for paged model states and batched decode, the same on one rank and on a mesh.

``paged_vs_contiguous(model)``: one prompt prefilled in three chunks then greedy-decoded,
once in a contiguous state and once in a paged state (non-adjacent, shuffled page ids in
L1 pools), plus a paged state resumed from a page-aligned prefix already in the pages
(and its Mamba slot). Returns the logits of all three, the greedy ids, and the largest
difference between the pool rows (read here from the page ids and in-page offsets, not
through the model's code) and the contiguous state's rows.

``batch_vs_sequential(model)``: sequences of different lengths, paged and contiguous
mixed, decoded greedily by one ``decode_batch`` per step and, as the reference, by
``decode`` one sequence at a time on twin states. Returns both logits and both ids.

Both are deterministic and collective: on a mesh every rank runs them with the same
arguments.
"""

from __future__ import annotations

import torch

from mesh_hicache.layout import kv_page_tokens
from mesh_hicache.pools.device import DevicePools
from runtime.model import HybridModel, SeqState, kv_shard_positions

PROMPT = 37
SPLIT = 20  # the first prefill chunk
RESUME = 16  # page-aligned resume point (page size 8 or 16)
NUM_DECODE = 6
LENGTHS = (1, 5, 12, 23, 31)  # batch_vs_sequential: one sequence each


def tokens(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def pools_for(model: HybridModel, num_pages: int = 64, num_slots: int = 4) -> DevicePools:
    """L1 pools laid out for this rank of ``model`` (as the cache builds them)."""
    return DevicePools(model.layout, num_pages=num_pages, num_slots=num_slots, device=model.device)


def shuffled_pages(count: int, num_pages: int, seed: int) -> list[int]:
    """``count`` distinct page ids in a seeded random order (never adjacent by construction)."""
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    return order[:count].tolist()


def save_slot(pools: DevicePools, state: SeqState, slot: int) -> None:
    for layer, conv in state.conv.items():
        pools.conv(layer)[slot] = conv
        pools.ssm(layer)[slot] = state.ssm[layer]


def pool_row_diff(model: HybridModel, pools: DevicePools, pages: list[int], ref: SeqState) -> float:
    """Max |pool row - contiguous row| over every attention field this rank keeps of the
    ``ref.num_tokens`` tokens (inf if a shape differs)."""
    ps, cp = model.page_size, model.comms.cp
    offset, _ = kv_page_tokens(ps, cp.size, cp.rank, model.cp_kv)
    n = ref.num_tokens
    if model.cp_kv == "shard" and cp.size > 1:
        positions = kv_shard_positions(n, ps, cp.size, cp.rank)
    else:
        positions = torch.arange(n)
    ids = torch.tensor(pages)[positions // ps]
    in_page = positions % ps - offset
    worst = 0.0
    fields = {
        "k": (ref.k, lambda lid: pools.k(lid)),
        "v": (ref.v, lambda lid: pools.v(lid)),
        "latent": (ref.latent, lambda lid: pools.k(lid)[:, :, 0]),
        "index_k": (ref.index_k, lambda lid: pools.indexer(lid)),
    }
    checked = 0
    for rows, pool_of in fields.values():
        for lid, want in rows.items():
            got = pool_of(lid)[ids, in_page]
            if got.shape != want.shape:
                return float("inf")
            if want.numel():
                worst = max(worst, float((got.float() - want.float()).abs().amax()))
            checked += 1
    has_attention = bool(set(model.local_layers) & set(model.config.attention_layers))
    assert checked or not has_attention
    return worst


def _greedy(model: HybridModel, state: SeqState, first: torch.Tensor) -> tuple[list, list[int]]:
    logits, ids = [first], []
    for _ in range(NUM_DECODE):
        ids.append(int(logits[-1].argmax()))
        logits.append(model.decode(ids[-1], state))
    return logits, ids


def paged_vs_contiguous(model: HybridModel, seed: int = 5, *, shuffle: bool = True) -> dict:
    """``shuffle=False``: the pages are runs of ids (the model reads pool views)."""
    vocab, ps = model.config.vocab_size, model.page_size
    ids = tokens(PROMPT, seed, vocab)
    total_pages = -(-(PROMPT + NUM_DECODE) // ps)
    pools = pools_for(model)
    pages = shuffled_pages(2 * total_pages, pools.num_pages, seed)
    if not shuffle:
        pages = list(range(3, 3 + 2 * total_pages))
    pages_a, rest = pages[:total_pages], pages[total_pages:]

    contiguous = model.new_state()  # the same chunks as the paged runs: the same sums
    model.prefill(ids[:RESUME], contiguous)
    model.prefill(ids[RESUME:SPLIT], contiguous)
    c_logits, c_ids = _greedy(model, contiguous, model.prefill(ids[SPLIT:], contiguous))

    paged = model.paged_state(pools, pages_a)
    model.prefill(ids[:RESUME], paged)
    has_slot = bool(model.config.ssm_layers)
    if has_slot:
        save_slot(pools, paged, 0)
    model.prefill(ids[RESUME:SPLIT], paged)
    p_logits, p_ids = _greedy(model, paged, model.prefill(ids[SPLIT:], paged))
    empty = not (paged.k or paged.v or paged.latent or paged.index_k)

    # Resume: the first RESUME // ps pages are run A's, the rest fresh ones.
    pages_b = pages_a[: RESUME // ps] + rest[: total_pages - RESUME // ps]
    resumed = model.paged_state(pools, pages_b, RESUME, slot=0 if has_slot else None)
    model.prefill(ids[RESUME:SPLIT], resumed)
    r_logits, r_ids = _greedy(model, resumed, model.prefill(ids[SPLIT:], resumed))
    return {
        "contiguous": torch.stack(c_logits),
        "paged": torch.stack(p_logits),
        "resumed": torch.stack(r_logits),
        "ids": (c_ids, p_ids, r_ids),
        "row_diff": pool_row_diff(model, pools, pages_a, contiguous),
        "row_diff_resumed": pool_row_diff(model, pools, pages_b, contiguous),
        "paged_state_empty": empty,
    }


def _prefilled(model: HybridModel, n: int, seed: int, pools: DevicePools | None, pages: list[int]):
    state = model.new_state() if pools is None else model.paged_state(pools, pages)
    logits = model.prefill(tokens(n, seed, model.config.vocab_size), state)
    return state, logits


def batch_vs_sequential(model: HybridModel, seed: int = 9, *, all_paged: bool = False) -> dict:
    """Sequence i (length LENGTHS[i]) is paged iff i is odd (every one with ``all_paged``:
    the batch attends in one padded gather); the reference runs on twin states (their own
    pools) with one ``decode`` per sequence and step."""
    ps = model.page_size
    per_seq = -(-(max(LENGTHS) + NUM_DECODE + 1) // ps)
    pools, twin_pools = pools_for(model), pools_for(model)
    num_pages = pools.num_pages
    order = shuffled_pages(num_pages - per_seq, num_pages - per_seq, seed)
    states, twins, first = [], [], []
    for i, n in enumerate(LENGTHS):
        pages = order[i * per_seq : (i + 1) * per_seq]  # disjoint per sequence
        if i == 1:  # one run of ids: the model reads a view of the pool, no gather
            pages = sorted(range(num_pages - per_seq, num_pages))
        paged = all_paged or i % 2
        state, logits = _prefilled(model, n, seed + i, pools if paged else None, pages)
        twin, _ = _prefilled(model, n, seed + i, twin_pools if paged else None, pages)
        states.append(state)
        twins.append(twin)
        first.append(logits)
    batched, sequential = [torch.stack(first)], [torch.stack(first)]
    b_ids: list[list[int]] = []
    s_ids: list[list[int]] = []
    for _ in range(NUM_DECODE):
        b_ids.append(batched[-1].argmax(-1).tolist())
        batched.append(model.decode_batch(b_ids[-1], states))
        s_ids.append(sequential[-1].argmax(-1).tolist())
        sequential.append(
            torch.stack([model.decode(t, s) for t, s in zip(s_ids[-1], twins, strict=True)])
        )
    one = twins[0].clone() if twins[0].pages is None else None
    single = None
    if one is not None:
        ref = twins[0].clone()
        single = (model.decode_batch([3], [one])[0], model.decode(3, ref))
    return {
        "batched": torch.stack(batched),
        "sequential": torch.stack(sequential),
        "ids": (b_ids, s_ids),
        "lengths": [s.num_tokens for s in states],
        "single": single,
    }
