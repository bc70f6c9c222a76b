"""What a target forward costs as a function of the tokens it runs (every request's tree and prefill chunk
together), learned online from the forwards the engine core really runs.

Per power-of-two bucket of tokens: moving averages of the tokens and the seconds of the forwards that fell in it.
An estimate interpolates linearly between measured buckets and extrapolates past them with the nearest segment's
slope (never flatter than the prior's anywhere), so a tree one node bigger never looks free. Before any measurement the
prior is cost(1) * (1 + PRIOR_SLOPE * (n - 1)) in units of one token's forward: relative costs are what the
scheduler compares.
"""
from __future__ import annotations

from dataclasses import dataclass, field

EMA = 0.2
PRIOR_SLOPE = 0.08  # extra cost per extra token, relative to a one-token forward (measured here: 0.08-0.1)


def bucket(n: int) -> int:
    return (n - 1).bit_length()  # 1 -> 0, 2 -> 1, 3..4 -> 2, 5..8 -> 3, ...


def ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA * (new - old)


@dataclass
class CostModel:
    points: dict[int, tuple[float, float]] = field(default_factory=dict)  # bucket -> (tokens, seconds) averages

    def record(self, tokens: int, seconds: float) -> None:
        b = bucket(tokens)
        old = self.points.get(b)
        self.points[b] = (tokens, seconds) if old is None else (ema(old[0], tokens), ema(old[1], seconds))

    def set(self, seconds_by_bucket: dict[int, float]) -> None:
        """Measured costs given by hand (tests, tools): bucket b's forwards ran 2**b tokens."""
        self.points = {b: (float(2**b), s) for b, s in seconds_by_bucket.items()}

    def seconds(self, n: int) -> float:
        """Estimated seconds of a forward of `n` tokens."""
        pts = sorted(self.points.values())
        if not pts:
            return 1 + PRIOR_SLOPE * (n - 1)
        t0, s0 = pts[0]
        floor = PRIOR_SLOPE * s0 / (1 + PRIOR_SLOPE * (t0 - 1))  # the prior's slope, scaled to the measured cost
        if len(pts) == 1:
            return max(s0 + floor * (n - t0), 1e-9)
        i = next((j for j in range(1, len(pts) - 1) if n < pts[j][0]), len(pts) - 1)
        (ta, sa), (tb, sb) = pts[i - 1], pts[i]
        slope = max((sb - sa) / (tb - ta) if tb > ta else 0.0, floor)  # noise never makes a bigger forward cheaper
        return max(sa + slope * (n - ta), 1e-9)
