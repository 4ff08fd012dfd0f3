"""Where an answer ends and what text of it may be sent: ``stop`` with OpenAI semantics.

:class:`AnswerText` follows an answer token by token. A token in the request's stop ids
(the checkpoint's end-of-sequence id, ``stop_token_ids``) ends the answer and is not part
of it. A ``stop`` string ends the answer as soon as the decoded text contains it; the text
is cut before it (the ``token_ids`` keep the tokens generated up to the one that completed
it). While streaming, text that could be the start of a stop string is held back until
it is known not to be one, and a trailing incomplete UTF-8 character until it completes.

The engine side and the HTTP side each run one: the engine's to decide, on every rank
of a mesh alike (decoding is deterministic), when to stop generating; the HTTP side's to
decide what to send. Both see the same tokens, so both stop at the same one.
"""

from __future__ import annotations

from runtime.server.params import StopSpec
from runtime.server.text import TextCodec


class AnswerText:
    """The answer of one request, fed one generated token at a time."""

    def __init__(self, codec: TextCodec, stop: StopSpec) -> None:
        self._codec = codec
        self._stop = stop
        self._longest = max((len(s) for s in stop.strings), default=0)
        self.ids: list[int] = []
        self.text = ""
        self._sent = 0
        self.stopped = False
        self.stop_reason: str | int | None = None
        """What stopped it (vLLM's ``stop_reason``): the stop string, the
        ``stop_token_ids`` id, None (end of sequence, or not stopped)."""
        self.generated = 0
        """Tokens generated (the ending one included: ``usage.completion_tokens``)."""

    @property
    def decodes(self) -> bool:
        return self._codec.has_text

    def push(self, token: int) -> str:
        """Take the next generated token; return the text now safe to send ("" while
        held back). After the answer stopped, tokens are ignored."""
        if self.stopped:
            return ""
        self.generated += 1
        armed = self.generated > self._stop.min_tokens
        if armed and token in self._stop.token_ids:
            self.stopped = True
            if token not in self._stop.eos_ids:
                self.stop_reason = token
                if self._stop.include_stop:
                    self.ids.append(token)
                    if self.decodes:
                        self.text = self._codec.decode(self.ids)
            return self._release(len(self.text))
        self.ids.append(token)
        if not self.decodes:
            return ""
        self.text = self._codec.decode(self.ids)
        if self._stop.strings and armed:
            found = self._find_stop()
            if found is not None:
                cut, string = found
                self.stopped = True
                self.stop_reason = string
                if self._stop.include_stop:
                    cut += len(string)
                self.text = self.text[:cut]
                return self._release(cut)
        safe = len(self.text)
        while safe > self._sent and self.text[safe - 1] == "\ufffd":
            safe -= 1  # an incomplete character: wait for its next bytes
        return self._release(min(safe, self._sent + self._unheld(safe)))

    def ends(self, token: int) -> bool:
        """The engine's per-token hook: True when ``token`` ends the answer."""
        self.push(token)
        return self.stopped

    def finish(self) -> str:
        """The text still held back, once the answer ended (any reason)."""
        return self._release(len(self.text))

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stopped else "length"

    def _find_stop(self) -> tuple[int, str] | None:
        # No stop string starts before what was sent: the held-back text guarantees it.
        found = [(self.text.find(s, self._sent), s) for s in self._stop.strings]
        hits = [(i, s) for i, s in found if i >= 0]
        return min(hits) if hits else None

    def _unheld(self, end: int) -> int:
        """How much of ``text[sent:end]`` may be sent: all but a tail that is the start
        of a stop string."""
        pending = self.text[self._sent : end]
        for keep in range(min(len(pending), self._longest - 1), 0, -1):
            tail = pending[-keep:]
            if any(s.startswith(tail) for s in self._stop.strings):
                return len(pending) - keep
        return len(pending)

    def _release(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out = self.text[self._sent : end]
        self._sent = end
        return out


def answer_of(codec: TextCodec, stop: StopSpec, output_ids: list[int]) -> AnswerText:
    """The whole answer of a finished request (its engine output replayed)."""
    answer = AnswerText(codec, stop)
    for token in output_ids:
        answer.push(token)
    return answer
