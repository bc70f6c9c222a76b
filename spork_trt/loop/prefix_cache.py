"""Prefix reuse in the KV pool: a finished request's committed rows stay in its slot after it leaves, indexed by
chained block hashes (as vLLM's automatic prefix caching), until the slot is needed.

A request whose prompt starts with a kept sequence is admitted into that slot, its rows cut to the shared prefix, and
prefills only the rest: at least its last prompt token, whose logits pick the first new token. Only committed rows
are ever kept (a tree's pending rows never are), and the index holds free slots only. A hit is checked token by token
(the hashes only find candidates), so a hash collision cannot reuse a wrong row. A request without a hit takes an
empty slot, else the least recently kept one, whose rows are evicted: reuse never blocks admission. Requests still
running share too: when one's committed rows hold a longer prefix of the prompt than any kept slot, they are copied
into the slot taken (`share`), so concurrent requests with the same system prompt or document prefill it once.

Rows computed while decoding (verified tree nodes) stand in for the rows a prefill would compute; the keystone
tests hold the answers with reuse on equal to reuse off.

Reuse is scoped: a request's `scope` (Submission.cache_scope: the OpenAI API's tenant, its API key and
`cache_salt`) must equal the kept or running rows' scope, so a request never learns, by its `cached_tokens` or its
time to first token, what another scope's prompts held.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from spork_trt.engines.kv_cache import KVPool

BLOCK = 16  # tokens per hashed block: a hit reuses at least one block


@dataclass(frozen=True)
class Taken:
    """A slot handed to a request."""

    slot: int
    reused: int  # committed rows kept for it: its prompt's first `reused` tokens


@dataclass
class PrefixStats:
    """Counters since start (Prometheus counters, see spork_trt/serving/triton_models/spork/model.py)."""

    hits: int = 0  # requests admitted onto kept rows (or rows copied from a running request)
    reused_tokens: int = 0  # prompt tokens those did not prefill
    evictions: int = 0  # kept sequences dropped to admit another request
    shared: int = 0  # requests whose rows were copied from a running request


@dataclass
class PrefixCache:
    """The pool's free slots, with the committed tokens each one's rows still hold."""

    pool: KVPool
    kept: dict[int, tuple[int, ...]] = field(default_factory=dict)  # free slot -> the tokens its rows hold
    blocks: dict[int, set[int]] = field(default_factory=dict)  # chained hash of a first k * BLOCK tokens -> slots
    hashes: dict[int, list[int]] = field(default_factory=dict)  # kept slot -> its chained block hashes
    used: dict[int, int] = field(default_factory=dict)  # free kept slot -> when it was kept (LRU clock)
    scopes: dict[int, str] = field(default_factory=dict)  # kept slot -> the scope its rows may be reused in
    clock: int = 0
    stats: PrefixStats = field(default_factory=PrefixStats)

    def take(self, prompt: list[int], reuse: bool = True, scope: str = "") -> Taken | None:
        """A free slot for `prompt` (None when every slot is in use): the one holding its longest kept prefix in
        `scope` when `reuse`, else an empty one, else the least recently kept one (evicted)."""
        if not self.pool.free:
            return None
        slot, n = self.match(prompt, scope) if reuse else (None, 0)
        if slot is None:
            empty = [s for s in self.pool.free if s not in self.kept]
            slot = min(empty) if empty else min(self.used, key=self.used.get)
            self.stats.evictions += slot in self.kept
        else:
            self.stats.hits, self.stats.reused_tokens = self.stats.hits + 1, self.stats.reused_tokens + n
        self.drop(slot)
        self.pool.take(slot)
        self.pool.caches[slot].truncate(n)
        return Taken(slot, n)

    def share(self, taken: Taken, prompt: list[int], running: dict[int, tuple[int, ...]]) -> Taken:
        """`taken`, or better: the longest prefix of `prompt` (at least one block, at most all but its last token)
        that a running request's committed rows hold, when longer than what `taken` kept, copied into its slot.
        `running`: slot -> the tokens its committed rows hold, from the first (prompt, then committed tokens), of the
        running requests in the new one's scope only."""
        caches, best, n = self.pool.caches, None, taken.reused
        for slot, tokens in running.items():
            m = common(tokens[:caches[slot].length], prompt, len(prompt) - 1)
            if m >= BLOCK and m > n:
                best, n = slot, m
        if best is None or not caches[taken.slot].adopt(caches[best], n):
            return taken
        self.stats.hits += taken.reused == 0
        self.stats.reused_tokens += n - taken.reused
        self.stats.shared += 1
        return Taken(taken.slot, n)

    def give_back(self, slot: int, tokens: list[int], scope: str = "") -> None:
        """A request leaves `slot`; `tokens`: what its committed rows hold (prompt, then committed tokens, as far as
        the target ran them), kept for reuse in `scope` ([] keeps nothing)."""
        n = min(len(tokens), self.pool.caches[slot].length)
        self.pool.give_back(slot, keep=n if n >= BLOCK else 0)
        if n < BLOCK:
            return
        self.kept[slot], self.used[slot], self.clock = tuple(tokens[:n]), self.clock, self.clock + 1
        self.scopes[slot] = scope
        self.hashes[slot] = chain_hashes(self.kept[slot])
        for h in self.hashes[slot]:
            self.blocks.setdefault(h, set()).add(slot)

    def match(self, prompt: list[int], scope: str = "") -> tuple[int | None, int]:
        """The kept slot of `scope` sharing the longest prefix with `prompt` (at least one block, at most all but
        its last token) and that prefix's length; (None, 0) without one."""
        limit, found = len(prompt) - 1, {s for s in self.kept if self.scopes[s] == scope}
        for depth, h in enumerate(chain_hashes(prompt[:limit])):
            span = slice(depth * BLOCK, (depth + 1) * BLOCK)  # the hash finds candidates, the tokens decide
            slots = {s for s in self.blocks.get(h, set()) & found if self.kept[s][span] == tuple(prompt[span])}
            if not slots:
                break
            found = slots
        else:
            depth = len(prompt[:limit]) // BLOCK
        if depth == 0:  # not one whole block in common
            return None, 0
        lengths = {s: common(self.kept[s], prompt, limit) for s in found}
        slot = max(found, key=lambda s: (lengths[s], self.used[s]))
        return slot, lengths[slot]

    def drop(self, slot: int) -> None:
        """Forget what `slot` holds (it is taken, or evicted)."""
        self.kept.pop(slot, None)
        self.used.pop(slot, None)
        self.scopes.pop(slot, None)
        for h in self.hashes.pop(slot, ()):
            self.blocks[h].discard(slot)
            if not self.blocks[h]:
                del self.blocks[h]


def chain_hashes(tokens) -> list[int]:
    """The hash of each whole block of `tokens` chained with the blocks before it: equal hashes at depth k mean
    (barring collisions) equal first k * BLOCK tokens."""
    out, h = [], 0
    for i in range(BLOCK, len(tokens) + 1, BLOCK):
        h = hash((h, tuple(tokens[i - BLOCK:i])))
        out.append(h)
    return out


def common(a: tuple[int, ...], b: list[int], limit: int) -> int:
    """Length of the common prefix of `a` and `b`, at most `limit`."""
    n = 0
    for x, y in zip(a[:limit], b[:limit]):
        if x != y:
            break
        n += 1
    return n
