"""Whether a step of the engine core proposes drafts at all: speculation under load, measured.

Proposing costs every request host time (store lookups, the verifier, the scheduler), and at high load the
allotment (scheduler.allot) may verify few or no nodes, or nodes whose expected gain the forward's cost model
overrates. So the core measures both: per power-of-two bucket of the batch size, committed tokens per second of
the decode part of steps that proposed and of steps that did not, as decayed sums of tokens over decayed sums of
seconds (a window of about 1 / (1 - DECAY) steps each: a step's committed tokens swing with what it accepted, and
a 5-step moving average of per-step rates flipped the choice on that noise). A step proposes when its bucket's
proposing steps have been at least as fast (or either is not measured yet) and proposing is not futile; every
PROBE_EVERY-th step does the opposite, so both rates stay measured as load and text change. Futile: a step of
FUTILE_BATCH or more requests whose allotment took no node marks that batch size and larger; any node taken clears
it. A batch below SWITCHED always proposes (a single request: its own scheduler's recovery decides there): the
allotment prices every node against the forward it adds, so a wrong "propose" costs only the host time of proposing,
while at 4 requests the switch's noisy comparison and a single empty allotment's futility mark kept proposing off for
about half of the steps (`python -m bench core` pricing, 80 MT-bench prompts at 4 in flight: README, "The engine core
in process, priced"). Sampled requests ignore the switch (engine core): their seeded draws depend on their trees,
which must not depend on timing; a step whose requests are all plain or sampled neither asks the switch nor teaches
it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from spork_trt.spec.cost_model import bucket

SWITCHED = 8  # smallest batch the switch decides for; smaller ones always propose
FUTILE_BATCH = SWITCHED  # smallest batch whose empty allotment marks proposing futile
PROBE_EVERY = 8  # every this many steps the switch does the opposite of its choice, to measure it
DECAY = 0.95  # weight of the history per step measured (a window of about 20 steps of each kind)


@dataclass
class DraftSwitch:
    sums: dict[tuple[int, bool], list[float]] = field(default_factory=dict)  # (batch bucket, proposed) ->
    # [decayed committed tokens, decayed seconds]
    futile_at: int | None = None  # batch size from which proposing is futile
    steps: int = 0

    def propose(self, batch: int) -> bool:
        """Whether this step of `batch` decoding requests proposes drafts."""
        self.steps += 1
        if batch < SWITCHED:
            return True
        k = bucket(batch)
        drafting, plain = self.rate((k, True)), self.rate((k, False))
        choice = (self.futile_at is None or batch < self.futile_at) and (
            drafting is None or plain is None or drafting >= plain)
        return choice != (self.steps % PROBE_EVERY == 0)

    def rate(self, key: tuple[int, bool]) -> float | None:
        """Committed tokens per second of (batch bucket, proposed) steps; None until one is measured."""
        t, s = self.sums.get(key, (0.0, 0.0))
        return t / s if s > 0 else None

    @property
    def rates(self) -> dict[tuple[int, bool], float]:
        """Every measured (batch bucket, proposed) -> committed tokens per second."""
        return {key: self.rate(key) for key in self.sums if self.rate(key) is not None}

    def record(self, batch: int, proposed: bool, tokens: int, seconds: float) -> None:
        """A decode step's committed tokens and seconds (proposals, forward, verification, commits)."""
        if batch >= SWITCHED and seconds > 0:
            acc = self.sums.setdefault((bucket(batch), proposed), [0.0, 0.0])
            acc[0], acc[1] = acc[0] * DECAY + tokens, acc[1] * DECAY + seconds

    def allotted(self, offered: list[int]) -> None:
        """The allotment's node counts for the requests that offered nodes this step."""
        if any(offered):
            self.futile_at = None
        elif len(offered) >= FUTILE_BATCH:
            self.futile_at = min(len(offered), self.futile_at or len(offered))
