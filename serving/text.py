"""One request's text side: new token ids in, new text out, stop strings found.

The engine works in tokens; stop strings need text. `TextStream` detokenises a request's
generated tokens incrementally (`serving.tokenizer.IncrementalDetokenizer`: never broken
UTF-8) and holds back the longest tail of the text that could still become a stop string, so
no text after a stop string is ever sent. When a stop string appears, the text before it is
released, the stream reports `stopped`, and the caller ends the request
(`Engine.cancel(request_id, FinishReason.STOP)`). As in vLLM, the stop string itself is not
part of the text, while the token that completed it stays in the token ids.

`TextStream.update` is that whole policy for one engine output; the gRPC loop and the batch
CLI both use it, so they cannot disagree about where a request's text ends.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from serving.engine import FinishReason, RequestOutput
from serving.tokenizer import IncrementalDetokenizer, Tokenizer

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


def stop_string_problems(stop: Sequence[str]) -> list[str]:
    """What is wrong with a request's stop strings (empty when they are fine)."""
    bad = []
    if len(stop) > MAX_STOP_STRINGS:
        bad.append(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for s in stop:
        if not isinstance(s, str) or not s:
            bad.append(f"stop strings must be non-empty strings, got {s!r}")
        elif len(s) > MAX_STOP_LENGTH:
            bad.append(f"stop strings must be at most {MAX_STOP_LENGTH} characters, got one of {len(s)}")
    return bad


@dataclasses.dataclass(frozen=True)
class TextUpdate:
    """What one engine output means for a request's text."""

    text: str  # new text to send (never past a stop string)
    cancel: bool  # a stop string appeared while the engine runs on: cancel it with FinishReason.STOP
    finish_reason: FinishReason | None  # on the request's final output: stop when a stop string ended it


class TextStream:
    """The text of one request's generated tokens, with stop strings. One thread uses it."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), stop: Sequence[str] = (), *,
                 skip_special_tokens: bool = True):
        bad = stop_string_problems(stop)
        if bad:
            raise ValueError("; ".join(bad))
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        self._stop = tuple(stop)
        self._held = ""  # decoded text not yet released (it could start a stop string)
        self.stopped = False
        self.text = ""  # everything released so far
        self._cancel_sent = False

    def update(self, out: RequestOutput) -> TextUpdate:
        """Take one engine output of this request (tokens after a stop string give no text)."""
        text = self.push(out.new_token_ids) if out.new_token_ids else ""
        cancel = self.stopped and not out.finished and not self._cancel_sent
        self._cancel_sent |= cancel
        if not out.finished:
            return TextUpdate(text, cancel, None)
        text += self.finish()
        return TextUpdate(text, False, FinishReason.STOP if self.stopped else out.finish_reason)

    def push(self, token_ids: Sequence[int]) -> str:
        """Text released by these tokens (possibly ''). After a stop string: '' forever."""
        if self.stopped:
            return ""
        return self._release(self._held + self._detok.push(token_ids), final=False)

    def finish(self) -> str:
        """The held-back text, at the end of the request (no stop string came)."""
        if self.stopped:
            return ""
        return self._release(self._held + self._detok.finish(), final=True)

    def _release(self, text: str, final: bool) -> str:
        # The stop is the stop string that is complete first in the text (the earliest end; of two
        # ending together, the longer), as if it came a character at a time: so the text does not
        # depend on how many tokens each step brings (speculative steps bring several), and a
        # stop string that only a later token would complete never cuts before one that is here.
        ends = [(i + len(s), i) for s in self._stop if (i := text.find(s)) >= 0]
        cut = min(ends)[1] if ends else -1
        if cut >= 0:
            self.stopped, self._held = True, ""
            out = text[:cut]
        elif final or not self._stop:
            self._held, out = "", text
        else:
            keep = max((k for s in self._stop for k in range(1, min(len(s), len(text) + 1))
                        if text.endswith(s[:k])), default=0)
            self._held, out = text[len(text) - keep:], text[:len(text) - keep]
        self.text += out
        return out
