"""``runtime.sampling`` on hand-made logits: each processing step as vLLM defines it, the
seeded draws, and greedy equal to the plain argmax bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.sampling import Sampler, SamplingParams


def _logits(*probs: float) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def _draws(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    """``n`` independent first draws (one fresh sampler per draw, seeds 0..n-1)."""
    out = []
    for seed in range(n):
        p = SamplingParams(**{**params.__dict__, "seed": seed})
        out.append(Sampler(p, [0]).pick(logits))
    return out


def test_plain_greedy_is_the_argmax_and_draws_nothing() -> None:
    logits = torch.randn(97, generator=torch.Generator().manual_seed(3))
    sampler = Sampler(SamplingParams(seed=5), [1, 2])
    assert SamplingParams(seed=5).plain
    assert sampler.pick(logits) == int(torch.argmax(logits))
    assert sampler.generator is None and sampler.logprobs == []
    # Greedy with logprobs still takes the argmax of the model's logits.
    with_lp = Sampler(SamplingParams(logprobs=3), [1])
    assert with_lp.pick(logits) == int(torch.argmax(logits))


def test_the_same_seed_draws_the_same_tokens_and_seeds_differ() -> None:
    logits = torch.zeros(50)
    params = SamplingParams(temperature=1.0, seed=11)
    first = [Sampler(params, [0]) for _ in range(2)]
    a = [first[0].pick(logits) for _ in range(20)]
    b = [first[1].pick(logits) for _ in range(20)]
    other = Sampler(SamplingParams(temperature=1.0, seed=12), [0])
    assert a == b
    assert a != [other.pick(logits) for _ in range(20)]


def test_temperature_one_samples_the_softmax() -> None:
    logits = _logits(0.6, 0.3, 0.1)
    draws = _draws(SamplingParams(temperature=1.0), logits, 3000)
    freq = [draws.count(i) / len(draws) for i in range(3)]
    # 3000 draws: a frequency's standard error is at most 0.009; 0.04 is > 4 of them.
    for got, want in zip(freq, (0.6, 0.3, 0.1), strict=True):
        assert abs(got - want) < 0.04, freq


def test_a_low_temperature_sharpens_and_top_k_one_is_greedy() -> None:
    logits = _logits(0.4, 0.35, 0.25)
    cold = _draws(SamplingParams(temperature=0.02), logits, 200)
    assert cold.count(0) >= 195  # (0.35/0.4)^50 ~ 0.1% weight left for the second token
    assert set(_draws(SamplingParams(temperature=2.0, top_k=1), logits, 100)) == {0}


def test_top_p_keeps_the_smallest_set_reaching_it() -> None:
    logits = _logits(0.5, 0.3, 0.15, 0.05)
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.7), logits, 300)) == {0, 1}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.01), logits, 50)) == {0}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.9), logits, 400)) == {0, 1, 2}


def test_top_k_and_min_p_mask_the_tail() -> None:
    logits = _logits(0.5, 0.3, 0.15, 0.05)
    assert set(_draws(SamplingParams(temperature=1.0, top_k=2), logits, 300)) == {0, 1}
    # min_p 0.25: tokens below 0.25 * 0.5 = 0.125 go.
    assert set(_draws(SamplingParams(temperature=1.0, min_p=0.25), logits, 400)) == {0, 1, 2}
    assert set(_draws(SamplingParams(temperature=1.0, min_p=0.7), logits, 100)) == {0}


def test_logit_bias_moves_the_greedy_token() -> None:
    logits = torch.tensor([3.0, 1.0, 0.0])
    assert Sampler(SamplingParams(logit_bias=((2, 5.0),)), [0]).pick(logits) == 2
    assert Sampler(SamplingParams(logit_bias=((0, -100.0),)), [0]).pick(logits) == 1


def test_penalties_follow_vllms_definitions() -> None:
    # Repetition: a seen token's positive logit is divided, a negative one multiplied.
    logits = torch.tensor([2.0, 1.5, -1.0, -1.2])
    rep = Sampler(SamplingParams(repetition_penalty=2.0), prompt=[0])
    assert rep.pick(logits) == 1  # 2.0 / 2 = 1.0 < 1.5
    seen_negative = Sampler(SamplingParams(repetition_penalty=2.0, logit_bias=()), prompt=[2])
    x = torch.tensor([-1.1, -5.0, -1.0])
    assert seen_negative.pick(x) == 0  # -1.0 * 2 = -2.0 < -1.1
    # Frequency: minus penalty x count in the output; presence: minus penalty once.
    freq = Sampler(SamplingParams(frequency_penalty=0.4), prompt=[3])
    flat = torch.tensor([1.0, 0.5, 0.0])
    assert [freq.pick(flat) for _ in range(4)] == [0, 0, 1, 0]  # 1.0, 0.6, 0.2 vs 0.5...
    pres = Sampler(SamplingParams(presence_penalty=0.6), prompt=[3])
    assert [pres.pick(flat) for _ in range(3)] == [0, 1, 0]  # 0.4 < 0.5; then 0.4 > 0.0
    # The prompt does not count for frequency or presence.
    assert Sampler(SamplingParams(presence_penalty=2.0), prompt=[0]).pick(flat) == 0


def test_min_tokens_masks_the_stop_ids_until_reached() -> None:
    logits = torch.tensor([0.0, 5.0, 1.0])
    params = SamplingParams(min_tokens=2, stop_ids=frozenset({1}))
    sampler = Sampler(params, [0])
    assert [sampler.pick(logits) for _ in range(3)] == [2, 2, 1]


def test_logprobs_are_the_raw_log_softmax() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    sampler = Sampler(SamplingParams(logprobs=2, logit_bias=((0, 50.0),)), [0])
    token = sampler.pick(logits)
    assert token == 0  # the bias moves the choice, not the reported log-probabilities
    want = torch.log_softmax(logits, dim=-1)
    entry = sampler.logprobs[0]
    assert entry.token == 0 and entry.logprob == pytest.approx(float(want[0]))
    assert [t for t, _ in entry.top] == [1, 2]
    assert [lp for _, lp in entry.top] == pytest.approx([float(want[1]), float(want[2])])
