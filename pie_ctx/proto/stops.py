"""Streaming text and stop strings for one generation (part of the contract: the engine
uses it for the generations it drives, the SDK for the ones it drives round by round).

Owns: the text of one generation's tokens. Incremental detokenization is the
tokenizer's (``IncrementalDecoder``: never splits a character); this module adds stop
strings on top: text is released only once it can no longer become part of a stop
string, so streamed text never leaks past a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol


class Decoder(Protocol):
    def feed(self, ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class StopChecker:
    """Turns generated token ids into released text deltas and finds stop strings.

    Args:
        new_decoder: makes a fresh incremental decoder (called again on ``reset``).
        stop_strings: strings that end the generation; the match and what follows are
            never released.
    """

    __slots__ = ("_new_decoder", "_decoder", "_stops", "_pending", "text", "stopped")

    def __init__(self, new_decoder: Callable[[], Decoder], stop_strings: Sequence[str]) -> None:
        self._new_decoder = new_decoder
        self._stops = [s for s in stop_strings if s]
        self.reset()

    def reset(self) -> None:
        """Forget everything (the job is replayed from its start after a preemption)."""
        self._decoder = self._new_decoder()
        self._pending = ""  # decoded text not yet released (may start a stop string)
        self.text = ""  # released text
        self.stopped = False

    def feed(self, token_id: int, *, final: bool = False) -> str:
        """Add one token; return the newly released text (possibly empty).

        Args:
            token_id: the sampled token (stop *tokens* are handled by the caller).
            final: no more tokens will come: release everything that is not a stop string.
        """
        self._pending += self._decoder.feed([token_id])
        if final:
            self._pending += self._decoder.flush()
        return self._release(final=final)

    def finish(self) -> str:
        """No more tokens: release what is held back (unless it contains a stop string)."""
        self._pending += self._decoder.flush()
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        pending = self._pending
        hits = [at for at in (pending.find(s) for s in self._stops) if at >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            out = pending[: min(hits)]
            self.text += out
            return out
        keep = 0 if final else self._holdback(pending)
        out = pending[: len(pending) - keep]
        self._pending = pending[len(pending) - keep :]
        self.text += out
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
