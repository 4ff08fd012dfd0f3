"""Gated delta rule: chunked prefill, one-token step and the cp chunk combination,
each against the naive sequential recurrence (float32, tolerance 1e-5)."""

from __future__ import annotations

import pytest
import torch

from runtime.model.gdn import (
    chunked_delta,
    combine_transitions,
    delta_step,
    l2norm,
    naive_delta,
    scan_with_transition,
)

TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(t: int, h: int = 3, dk: int = 5, dv: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(t, h, dk, generator=gen)) * dk**-0.5
    k = l2norm(torch.randn(t, h, dk, generator=gen))
    v = torch.randn(t, h, dv, generator=gen)
    g = -torch.rand(t, h, generator=gen) * 0.5
    beta = torch.rand(t, h, generator=gen)
    s0 = torch.randn(h, dk, dv, generator=gen)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize(("t", "chunk"), [(1, 4), (7, 3), (16, 4), (33, 8), (20, 64)])
def test_chunked_equals_naive(t: int, chunk: int) -> None:
    q, k, v, g, beta, s0 = _inputs(t)
    ref = naive_delta(q, k, v, g, beta, s0)
    got = chunked_delta(q, k, v, g, beta, s0, chunk)
    torch.testing.assert_close(got.out, ref.out, **TOL)
    torch.testing.assert_close(got.final_state, ref.final_state, **TOL)
    assert not torch.allclose(ref.final_state, s0)  # the state moved


def test_decode_steps_equal_prefill() -> None:
    q, k, v, g, beta, s0 = _inputs(9, seed=1)
    ref = naive_delta(q, k, v, g, beta, s0)
    state, outs = s0, []
    for i in range(9):
        sl = slice(i, i + 1)
        step = delta_step(q[sl], k[sl], v[sl], g[sl], beta[sl], state)
        state = step.final_state
        outs.append(step.out)
    torch.testing.assert_close(torch.cat(outs), ref.out, **TOL)
    torch.testing.assert_close(state, ref.final_state, **TOL)


@pytest.mark.parametrize("cuts", [(0, 5, 11, 17), (0, 0, 6, 17), (0, 8, 17, 17)])
def test_cp_chunks_combine_exactly(cuts: tuple[int, ...]) -> None:
    q, k, v, g, beta, s0 = _inputs(17, seed=2)
    ref = naive_delta(q, k, v, g, beta, s0)
    parts = [
        scan_with_transition(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], 4)
        for a, b in zip(cuts[:-1], cuts[1:], strict=True)
    ]
    entering, final = combine_transitions(
        torch.stack([p.transition for p in parts]), torch.stack([p.final_state for p in parts]), s0
    )
    outs = [
        p.out + torch.einsum("thk,hkv->thv", p.readout, entering[r]) for r, p in enumerate(parts)
    ]
    torch.testing.assert_close(torch.cat(outs), ref.out, **TOL)
    torch.testing.assert_close(final, ref.final_state, **TOL)
