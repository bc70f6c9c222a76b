"""When to speculate. Recovery: rollback is free (the commit keeps only what the target agreed with); after
`fail_limit` consecutive steps with nothing accepted, decode plainly for `cooldown` steps, then probe again."""
from __future__ import annotations

from dataclasses import dataclass

from .config import SpecConfig


@dataclass
class Recovery:
    spec: SpecConfig
    failures: int = 0  # consecutive speculative steps with nothing accepted
    cooling: int = 0  # plain steps left before probing again
    fallbacks: int = 0  # times speculation was switched off

    def speculate(self) -> bool:
        return self.cooling == 0

    def record(self, speculated: bool, accepted: int) -> None:
        if not speculated:
            self.cooling = max(0, self.cooling - 1)
            return
        self.failures = 0 if accepted else self.failures + 1
        if self.failures >= self.spec.fail_limit:
            self.failures, self.cooling = 0, self.spec.cooldown
            self.fallbacks += 1
