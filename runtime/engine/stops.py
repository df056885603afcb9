"""Streaming text and stop strings for one generation.

Owns the incremental detokenization of a job's generated tokens. Text is released to the
caller only when it can no longer become part of a stop string and does not end inside a
multi-byte character, so streamed text never leaks past a stop string and never splits a
character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class StopChecker:
    """Turns generated token ids into text deltas and finds stop strings.

    Decoding works on a sliding window of tokens (``_prefix``..end) so each step costs
    O(window), not O(generated); the window restarts whenever text was released.
    """

    __slots__ = ("_decode", "_stops", "_tokens", "_prefix", "_read", "_pending", "text", "stopped")

    def __init__(self, decode: Decode, stop_strings: Sequence[str]) -> None:
        self._decode = decode
        self._stops = [s for s in stop_strings if s]
        self.reset()

    def reset(self) -> None:
        self._tokens: list[int] = []
        self._prefix = 0  # window start: tokens before it are fully released as text
        self._read = 0  # tokens up to here have been turned into `text + _pending`
        self._pending = ""  # decoded text not yet released (may start a stop string)
        self.text = ""  # released text
        self.stopped = False

    def feed(self, token_id: int, *, final: bool = False) -> str:
        """Add one token; return the newly released text (possibly empty).

        Args:
            token_id: the sampled token (already excluded by the caller if it is a stop token).
            final: no more tokens will come: release everything that is not a stop string.
        """
        self._tokens.append(token_id)
        before = self._decode(self._tokens[self._prefix : self._read])
        window = self._decode(self._tokens[self._prefix :])
        if window.endswith("\ufffd") and not final:
            return self._release(final=False)  # a character is still incomplete
        if len(window) >= len(before) and window.startswith(before):
            self._pending += window[len(before) :]
        else:  # the tokenizer re-segmented the window (rare); trust the longer decode
            self._pending += window[len(before) :] if len(window) > len(before) else ""
        self._read = len(self._tokens)
        return self._release(final=final)

    def finish(self) -> str:
        """No more tokens: release what is held back (unless it is a complete stop string)."""
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        pending = self._pending
        for stop in self._stops:
            at = pending.find(stop)
            if at >= 0:
                self.stopped = True
                self._pending = ""
                out = pending[:at]
                self.text += out
                return out
        keep = 0 if final else self._holdback(pending)
        out = pending[: len(pending) - keep]
        self._pending = pending[len(pending) - keep :]
        self.text += out
        if out and not self._pending:
            # Everything read is released: restart the window, keeping one token of left
            # context (SentencePiece drops a word's leading space at a window's start).
            self._prefix = max(self._read - 1, 0)
        return out

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
