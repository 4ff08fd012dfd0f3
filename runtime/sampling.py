"""Choosing the next token from a request's logits: greedy or sampled, with vLLM's
logits processing, and the log-probabilities a request asked for.

:class:`SamplingParams` is what a request asks (picklable: ranks of a mesh receive it
with the request); :class:`Sampler` is one request's state (its seeded generator, the
tokens generated so far for the penalties). The order on the logits (float32
``[vocab]``) is vLLM's:

1. ``min_tokens``: the stop ids are masked (-inf) until that many tokens are out;
2. ``logit_bias`` added;
3. penalties: ``repetition_penalty`` on every token seen in the prompt or the output
   (a positive logit divided by it, a negative one multiplied), then
   ``frequency_penalty`` times each token's count in the output and
   ``presence_penalty`` once for each token in the output, both subtracted;
4. ``temperature`` 0: argmax of the processed logits (with nothing to process: of the
   model's logits themselves, bit for bit the plain greedy decode). Otherwise divided by
   the temperature, then ``min_p`` (tokens with probability below ``min_p`` times the
   largest masked), ``top_k`` (the k largest kept), ``top_p`` (the smallest set of most
   likely tokens whose probability reaches ``top_p`` kept; always at least one), and one
   draw from the resulting distribution with the request's own ``torch.Generator``.

The generator is seeded from ``seed`` and used by nothing else, so a request's draws do
not depend on which requests share its batch. Every rank of a mesh receives identical
logits (``HybridModel.decode_batch``) and the same seed, so every rank draws the same
token without a collective. Log-probabilities (``logprobs``) are those of the model's
raw logits (vLLM's default ``raw_logprobs``): the chosen token's and the ``logprobs``
most likely ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20
"""The most ``logprobs`` / ``top_logprobs`` a request may ask (vLLM's default limit)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens (the defaults: plain greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1: no top-k."""
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()
    """The ids masked while fewer than ``min_tokens`` tokens are out (end of sequence and
    ``stop_token_ids``)."""
    logprobs: int | None = None
    """None: no log-probabilities; N >= 0: the chosen token's and the N most likely."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain(self) -> bool:
        """Nothing to compute but an argmax (no processing, no log-probabilities)."""
        return self == SamplingParams(seed=self.seed, stop_ids=self.stop_ids)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The log-probabilities at one generated position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    """The most likely tokens, most likely first."""


class Sampler:
    """One request's token choice: call :meth:`pick` with each position's logits."""

    def __init__(self, params: SamplingParams, prompt: list[int]) -> None:
        self.params = params
        self.prompt = prompt
        self.output: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.generator: torch.Generator | None = None
        self._counts: torch.Tensor | None = None
        self._prompt_mask: torch.Tensor | None = None

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from float32 ``[vocab]`` logits (recorded for the penalties and,
        when asked, its log-probabilities in :attr:`logprobs`)."""
        p = self.params
        if p.plain:
            token = int(torch.argmax(logits))
        else:
            token = self._choose(logits)
        if p.logprobs is not None:
            self.logprobs.append(_logprobs_of(logits, token, p.logprobs))
        self.output.append(token)
        if self._counts is not None:
            self._counts[token] += 1
        return token

    def _choose(self, logits: torch.Tensor) -> int:
        p = self.params
        x = logits.to(torch.float32).clone()
        if p.min_tokens and len(self.output) < p.min_tokens and p.stop_ids:
            x[[i for i in p.stop_ids if i < x.shape[0]]] = float("-inf")
        if p.logit_bias:
            where = torch.tensor([i for i, _ in p.logit_bias], dtype=torch.long, device=x.device)
            bias = torch.tensor([b for _, b in p.logit_bias], dtype=x.dtype, device=x.device)
            x.index_add_(0, where, bias)
        self._penalize(x)
        if p.greedy:
            return int(torch.argmax(x))
        x = x / p.temperature
        if p.min_p > 0.0:
            probs = torch.softmax(x, dim=-1)
            x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if 0 < p.top_k < x.shape[0]:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            x = _top_p(x, p.top_p)
        probs = torch.softmax(x, dim=-1)
        if self.generator is None:
            self.generator = torch.Generator(device=x.device)
            self.generator.manual_seed(0 if p.seed is None else p.seed)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _penalize(self, x: torch.Tensor) -> None:
        p = self.params
        if p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty:
            return
        if self._counts is None:
            self._counts = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
            for token in self.output:
                self._counts[token] += 1
        seen = self._counts > 0
        if p.repetition_penalty != 1.0:
            if self._prompt_mask is None:
                self._prompt_mask = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
                self._prompt_mask[torch.tensor(self.prompt, dtype=torch.long)] = True
            hit = seen | self._prompt_mask
            scaled = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x.copy_(torch.where(hit, scaled, x))
        x -= p.frequency_penalty * self._counts
        x -= p.presence_penalty * seen.to(x.dtype)


def _top_p(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens whose probabilities sum to ``top_p`` (at least one):
    drop, in ascending order, every token whose cumulative probability stays within
    ``1 - top_p``."""
    sorted_x, order = torch.sort(x, descending=False)
    cumulative = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1.0 - top_p
    drop[-1] = False
    mask = torch.zeros_like(drop).scatter_(0, order, drop)
    return x.masked_fill(mask, float("-inf"))


def _logprobs_of(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logp, min(top, logp.shape[0]))
        best = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(token, float(logp[token]), best)
