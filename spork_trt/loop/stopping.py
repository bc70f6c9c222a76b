"""Stop rule, applied to committed tokens only: EOS, stop strings, max new tokens.

A stop inside a multi-token commit truncates there, so every mode (plain or speculative) ends on exactly the same
tokens and text. The text ends where the first stop string starts (`cut`); a stream holds back the tokens whose text
could still begin one (`StopState.held`), so no response carries part of a stop string.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class StopState:
    eos_ids: frozenset[int]
    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = None  # needed only with stop strings
    tokens: list[int] = field(default_factory=list)  # generated so far (EOS excluded)
    reason: str | None = None  # "eos" | "stop_string" | "max_tokens" once stopped

    def __post_init__(self) -> None:
        assert not self.stop_strings or self.decode is not None, "stop strings need a decode function"
        # a stop string of L characters that first appears with the latest token lies within its last 4L + 2
        # tokens (a token adds at least one byte, a character is at most 4): only that tail is decoded per token
        self.window = 4 * max(map(len, self.stop_strings), default=0) + 2

    def add(self, new: list[int]) -> list[int]:
        """Append committed tokens; return those kept (a prefix of `new`). Sets `reason` when generation ends."""
        kept: list[int] = []
        for t in new:
            if self.reason is not None:
                break
            if t in self.eos_ids:
                self.reason = "eos"
                break
            self.tokens.append(t)
            kept.append(t)
            if self.stop_strings and self.stopped(self.decode(self.tokens[-self.window:])):
                self.reason = "stop_string"
            elif len(self.tokens) >= self.max_new_tokens:
                self.reason = "max_tokens"
        return kept

    def stopped(self, tail: str) -> bool:
        return any(s in tail for s in self.stop_strings)

    def text(self) -> str:
        """The generated text, cut before the first stop string."""
        assert self.decode is not None
        return cut(self.decode(self.tokens), self.stop_strings)

    def held(self) -> int:
        """How many of the last tokens a stream holds back while running: those whose text could still begin a stop
        string (the text so far ends with a proper prefix of one), so no response carries a part of a stop string
        that later tokens complete. 0 without stop strings or once stopped."""
        if not self.stop_strings or self.reason is not None:
            return 0
        tail = self.tokens[-self.window:]
        text = self.decode(tail)
        start = len(text) - partial_stop(text, self.stop_strings)  # where a stop string could begin
        n = 0
        while start < len(text) and n < len(tail) and len(self.decode(tail[:len(tail) - n])) > start:
            n += 1
        return n


def cut(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to where the first of `stops` in it starts (all of it if none is there)."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(cuts)] if cuts else text


def partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that could begin a stop string: the longest suffix that is a proper prefix of
    one of `stops` (0 if none is)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
