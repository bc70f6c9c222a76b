"""Stop strings over a stream of text: the answer ends exactly where the first stop string starts, and only text
that could still begin one is held back (the engine core's own rule, stopping.cut and stopping.partial_stop, on
text)."""
from __future__ import annotations

from spork_trt.loop.stopping import cut, partial_stop


class StopFilter:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops, self.held, self.stopped = stops, "", False

    def feed(self, text: str) -> str:
        """The text that is safe to send now; sets `stopped` when a stop string appeared (nothing after it goes)."""
        if self.stopped:
            return ""
        buf = self.held + text
        before = cut(buf, self.stops)
        if len(before) < len(buf):
            self.stopped, self.held = True, ""
            return before
        keep = partial_stop(buf, self.stops)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """At the end of the answer: the held-back text (it never became a stop string)."""
        out, self.held = self.held, ""
        return out


def tokens_through_stop(ids: list[int], decode, stops: tuple[str, ...]) -> int:
    """How many of `ids` the answer took: through the token that completed the first stop string (where the engine
    core's own stop rule would have ended it); all of them if none appears."""
    def has_stop(k: int) -> bool:
        text = decode(ids[:k])
        return any(s in text for s in stops)

    if not has_stop(len(ids)):
        return len(ids)
    lo, hi = 1, len(ids)  # the text of a longer prefix extends a shorter one's: binary search the first with a stop
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if has_stop(mid) else (mid + 1, hi)
    return lo
