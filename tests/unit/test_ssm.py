"""SSM math: chunked scan vs the naive recurrence, CP chunk chaining, conv halos."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.model.parallel import cp_chunk_bounds
from runtime.model.ssm import (
    advance_window,
    causal_conv,
    chunked_scan,
    combine_chunk_states,
    naive_scan,
    prefix_correction,
)

H, P, N, C, K = 3, 4, 5, 7, 4
ATOL = 1e-5  # float32; only summation order differs between the forms


def _inputs(t: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(t, H, P, generator=gen),
        "dt": F.softplus(torch.randn(t, H, generator=gen) - 1.0),
        "A": -torch.rand(H, generator=gen) * 2.0 - 0.1,
        "B": torch.randn(t, H, N, generator=gen),
        "C": torch.randn(t, H, N, generator=gen),
    }


def _state(seed: int = 1) -> torch.Tensor:
    return torch.randn(H, P, N, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("t", [1, 13, 40])
@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_chunked_scan_equals_naive(t: int, chunk: int) -> None:
    inp, state = _inputs(t), _state()
    ref = naive_scan(**inp, state=state)
    got = chunked_scan(**inp, state=state, chunk=chunk)
    torch.testing.assert_close(got.y, ref.y, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got.final_state, ref.final_state, atol=ATOL, rtol=ATOL)


def test_naive_scan_is_the_recurrence() -> None:
    # Two tokens by hand, so the reference itself is pinned down.
    inp, s0 = _inputs(2), _state()
    x, dt, A, B, C = inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"]
    s1 = torch.exp(dt[0] * A)[:, None, None] * s0 + dt[0][:, None, None] * torch.einsum(
        "hp,hn->hpn", x[0], B[0]
    )
    s2 = torch.exp(dt[1] * A)[:, None, None] * s1 + dt[1][:, None, None] * torch.einsum(
        "hp,hn->hpn", x[1], B[1]
    )
    ref = naive_scan(**inp, state=s0)
    torch.testing.assert_close(ref.final_state, s2)
    torch.testing.assert_close(ref.y[0], torch.einsum("hpn,hn->hp", s1, C[0]))


def test_carried_state_resume() -> None:
    # Scanning A then B (carrying the state) equals scanning A+B.
    inp, s0 = _inputs(30), _state()
    whole = chunked_scan(**inp, state=s0, chunk=8)
    head = {k: v[:11] if v.dim() > 1 else v for k, v in inp.items()}
    tail = {k: v[11:] if v.dim() > 1 else v for k, v in inp.items()}
    first = chunked_scan(**head, state=s0, chunk=8)
    second = chunked_scan(**tail, state=first.final_state, chunk=8)
    torch.testing.assert_close(torch.cat([first.y, second.y]), whole.y, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(second.final_state, whole.final_state, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize(("t", "cp"), [(29, 2), (29, 4), (3, 4), (8, 4)])
def test_cp_chunks_equal_one_chunk(t: int, cp: int) -> None:
    # Each cp chunk scans from zero; chaining (decay, state) and correcting is exact,
    # including the carried-in state of a cached prefix and empty chunks (t < cp).
    inp, carried = _inputs(t), _state()
    ref = naive_scan(**inp, state=carried)
    bounds = cp_chunk_bounds(t, cp)
    parts = []
    for s, e in bounds:
        part = {k: v[s:e] if v.dim() > 1 else v for k, v in inp.items()}
        local = chunked_scan(**part, state=torch.zeros(H, P, N), chunk=4)
        parts.append((part, local))
    decays = torch.stack([(p["dt"] * p["A"]).sum(0) for p, _ in parts])
    chained = combine_chunk_states(
        decays, torch.stack([lo.final_state for _, lo in parts]), carried
    )
    ys = [
        lo.y + prefix_correction(p["dt"], p["A"], p["C"], chained.initial[r])
        for r, (p, lo) in enumerate(parts)
    ]
    torch.testing.assert_close(torch.cat(ys), ref.y, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(chained.final_state, ref.final_state, atol=ATOL, rtol=ATOL)
    # Without the correction the result is wrong (the test can fail).
    assert not torch.allclose(torch.cat([lo.y for _, lo in parts]), ref.y, atol=1e-3)


@pytest.mark.parametrize("sizes", [[5, 6], [1, 2, 5, 0, 3], [0, 2, 1, 8], [11]])
def test_conv_halo_at_chunk_edges(sizes: list[int]) -> None:
    gen = torch.Generator().manual_seed(3)
    t = sum(sizes)
    xbc = torch.randn(t, C, generator=gen)
    weight, bias = torch.randn(C, K, generator=gen), torch.randn(C, generator=gen)
    start_window = torch.randn(K - 1, C, generator=gen)  # a cached prefix's conv state
    ref = causal_conv(xbc, start_window, weight, bias)
    # The reference against the definition at every position.
    padded = torch.cat([start_window, xbc])
    direct = torch.stack([F.silu((weight * padded[i : i + K].T).sum(-1) + bias) for i in range(t)])
    torch.testing.assert_close(ref, direct, atol=ATOL, rtol=ATOL)
    # Chunks with halos built only from the tails (<= K-1 rows) of earlier chunks.
    out, window, start = [], start_window, 0
    for size in sizes:
        chunk = xbc[start : start + size]
        out.append(causal_conv(chunk, window, weight, bias))
        window = advance_window(window, chunk[-(K - 1) :] if size else chunk)
        start += size
    torch.testing.assert_close(torch.cat(out), ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(window, padded[-(K - 1) :])
    # A zero halo instead would differ at chunk starts.
    if sizes[0] and len(sizes) > 1 and sizes[1]:
        wrong = causal_conv(xbc[sizes[0] : sum(sizes[:2])], torch.zeros(K - 1, C), weight, bias)
        assert not torch.allclose(wrong[0], ref[sizes[0]], atol=1e-3)


@pytest.mark.parametrize("groups", [1, 2])
def test_grouped_b_c_equal_per_head_copies(groups: int) -> None:
    # B/C shared by groups of heads: the scan and the prefix correction computed per
    # group equal the per-head recurrence with each group's B/C repeated over its heads.
    gen = torch.Generator().manual_seed(5)
    t, h, p, n = 37, 4, 3, 5
    x = torch.randn(t, h, p, generator=gen)
    dt = F.softplus(torch.randn(t, h, generator=gen))
    A = -torch.rand(h, generator=gen) - 0.5
    B, C = torch.randn(t, groups, n, generator=gen), torch.randn(t, groups, n, generator=gen)
    state = torch.randn(h, p, n, generator=gen)
    Bh, Ch = (m.repeat_interleave(h // groups, dim=1) for m in (B, C))
    want = naive_scan(x, dt, A, Bh, Ch, state)
    got = chunked_scan(x, dt, A, B, C, state, chunk=8)
    torch.testing.assert_close(got.y, want.y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.final_state, want.final_state, atol=1e-4, rtol=1e-4)
    zero = chunked_scan(x, dt, A, B, C, torch.zeros_like(state), chunk=8)
    torch.testing.assert_close(
        zero.y + prefix_correction(dt, A, C, state), want.y, atol=1e-4, rtol=1e-4
    )
