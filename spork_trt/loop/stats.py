"""Per-request decoding statistics, named as in DESIGN.md's glossary."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    steps: int = 0
    draft_tokens: int = 0  # draft tokens verified by the target
    accepted_tokens: int = 0  # draft tokens accepted
    committed_tokens: int = 0  # accepted + bonus, after stop truncation
    cached_tokens: int = 0  # prompt tokens whose KV rows a finished request left (prefix reuse): not prefilled
    time_s: float = 0.0
    prefill_s: float = 0.0
    propose_s: float = 0.0
    verify_s: float = 0.0
    fallbacks: int = 0  # times recovery switched to plain decoding
    pruned_tokens: int = 0  # draft tokens the scheduler dropped before verification
    score_s: float = 0.0  # time in the verifier
    scored_steps: int = 0  # steps the verifier scored
    verifier_offs: int = 0  # times the scheduler switched the verifier off because it did not pay
    gated_steps: int = 0  # gate mode (lossy): steps the verifier alone accepted
    gated_tokens: int = 0  # tokens committed without target verification
    grammar_s: float = 0.0  # time in the grammar engine: masks, tree walks, advancing, masking logits
    forced_tokens: int = 0  # tokens a grammar allowed alone, committed without a verdict (jump-forward; lossless)
    accepted_length_histogram: dict[int, int] = field(default_factory=dict)  # accepted per step -> steps

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.committed_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.committed_tokens / self.time_s if self.time_s > 0 else 0.0

    def add_times(self, propose_s: float, score_s: float, verify_s: float, scored: bool) -> None:
        self.propose_s += propose_s
        self.score_s += score_s
        self.verify_s += verify_s
        self.scored_steps += scored

    def record_step(self, draft: int, accepted: int, gated: int = 0) -> None:
        self.steps += 1
        self.gated_steps += gated > 0
        self.gated_tokens += gated
        self.draft_tokens += draft
        self.accepted_tokens += accepted
        self.accepted_length_histogram[accepted] = self.accepted_length_histogram.get(accepted, 0) + 1

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length,
                 tokens_per_second=self.tokens_per_second)
        d["accepted_length_histogram"] = {str(k): v for k, v in sorted(self.accepted_length_histogram.items())}
        return d
