"""Whether a request's verifier scores its next speculative step, and how hard its scores prune (the scheduler's
verifier concern; scheduler.py has the rest).

tau, the pruning threshold on the verifier's path survival, moves toward `target_acceptance` of the verified nodes
after every scored step. In "auto" the verifier must pay for itself: the target verify time its pruning saves (the
cost model's price of what the (depth, rank) pruning alone would have verified, `baseline_n`, minus what it kept)
must exceed its own measured time. It starts off and is probed after FIRST_PROBE speculative steps (once the verify
costs are measured); it stays on while it pays; otherwise the next probe comes PROBE_EVERY steps later, doubling
after each probe that did not pay (up to PROBE_MAX). "on" (and gate mode, which needs the scores) always scores,
"off" never.
"""
from __future__ import annotations

from dataclasses import dataclass

from spork_trt.config import SpecConfig
from spork_trt.spec.cost_model import CostModel, ema

TAU_BOUNDS = (0.002, 0.9)
TAU_STEP = 0.05  # tau moves by this times (target acceptance - measured acceptance) per scored step
FIRST_PROBE = 4  # speculative steps before "auto" first tries the verifier
PROBE_EVERY = 16  # speculative steps between probes of a verifier switched off (doubles while it does not pay)
PROBE_MAX = 256


@dataclass
class VerifierSwitch:
    spec: SpecConfig
    costs: CostModel  # target forward seconds by tokens (the core's, shared)
    tau: float = 0.0  # pruning threshold on the verifier's path survival
    on: bool = False  # "auto" only: the verifier currently pays for itself
    offs: int = 0  # probes after which "auto" left (or switched) the verifier off
    probe_in: int = FIRST_PROBE  # speculative steps until a verifier switched off is tried again
    probe_every: int = PROBE_EVERY
    score_cost: float | None = None  # seconds per verifier call
    score_saving: float | None = None  # target verify seconds its pruning saves per call (cost model)
    baseline_n: int = 0  # nodes the (depth, rank) pruning alone would have verified this step

    def __post_init__(self) -> None:
        self.tau = self.spec.tau

    def use(self, available: bool) -> bool:
        """Whether to score this speculative step (`available`: a calibrated head, or --verifier on)."""
        mode = self.spec.verifier
        if not available:
            return False
        if mode == "on" or self.spec.gate_tau > 0:  # gate mode needs the scores whatever --verifier says
            return True
        if mode == "off" or self.on:
            return mode != "off"
        self.probe_in -= 1
        return self.probe_in <= 0

    def scored(self, score_s: float, acceptance: float, n: int) -> None:
        """After a verified step the verifier scored (`n` nodes verified): move tau, weigh the verifier's cost
        against its saving."""
        lo, hi = TAU_BOUNDS
        self.tau = min(hi, max(lo, self.tau + TAU_STEP * (self.spec.target_acceptance - acceptance)))
        self.score_cost = ema(self.score_cost, score_s)
        saving = max(0.0, self.costs.seconds(self.baseline_n) - self.costs.seconds(n)) if self.baseline_n else 0.0
        self.score_saving = ema(self.score_saving, saving)
        if self.spec.verifier != "auto" or self.spec.gate_tau > 0:
            return
        pays = self.score_saving > self.score_cost
        self.offs += not pays
        self.probe_every = PROBE_EVERY if pays else min(PROBE_MAX, 2 * self.probe_every)
        self.on, self.probe_in = pays, self.probe_every
