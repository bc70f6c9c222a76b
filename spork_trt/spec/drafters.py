"""Drafters: propose a token tree from the committed context. One interface, five kinds.

  reset(prompt_ids, max_len)    start a sequence (model drafters prefill their own KV cache)
  propose(root, spec) -> DraftTree   node 0 = root (the last committed token); draft nodes below it
  commit(tree, verdict)         keep state in step with what the target committed (tree may be root-only when
                                the loop decoded plainly this step)

Model drafters (a separate draft model, a quantized copy of the target, the target's first N layers) grow a
dynamic tree: per depth, the top-K children of every node of the previous depth, keeping the K with the highest
cumulative draft probability (within the node budget); one draft forward per depth. `proposing` is the same
proposal as a generator of its forwards, so the engine core runs every request's draft forwards of a depth as ONE
batched forward (`drive`). The n-gram drafter
looks the recent suffix up in prompt + output; distinct continuations become forks. The store drafter adds forks
from a datastore of the target's own generations where the context has too few. The hybrid drafter uses
the n-gram drafter when the context repeats itself and a model drafter otherwise. The learned head's drafters
(`--draft eagle`, `--draft store-eagle`) are in eagle.py.
"""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from spork_trt.config import SamplingConfig, SpecConfig
from spork_trt.spec.datastore import KEY, Datastore
from spork_trt.engines import SeqInput, chain_input, prefill
from spork_trt.engines.isolation import forward_each
from spork_trt.engines.kv_cache import Rows
from spork_trt.spec.tree import DraftTree, covered
from spork_trt.spec.tree_growth import grow_steps
from spork_trt.spec.verification import Verdict


class Drafter(Protocol):
    """Every drafter subclasses this: the engine core reads the capabilities declared here (their defaults: none),
    never probes for them. They match the kind's row (draft_kinds: `batched`, `wants_hidden`)."""

    batched: ClassVar[bool] = False  # proposes through `proposing` (the engine core batches its draft forwards)
    wants_hidden: ClassVar[bool] = False  # the engine core passes the target's hidden states to `observe`

    def reset(self, prompt_ids: list[int], max_len: int, rows: Rows | None = None) -> None:
        """Start a sequence; `rows`: the target's KV cache, the prompt's rows committed (a self-draft may take them)."""

    def propose(self, root: int, spec: SpecConfig) -> DraftTree: ...

    def commit(self, tree: DraftTree, verdict: Verdict) -> None: ...

    def proposing(self, root: int, spec: SpecConfig) -> Proposing:
        """`propose` as a generator of its draft forwards (batched drafters only): yields (engine, SeqInput) per
        draft forward, is sent its logits [r, V], returns the tree."""
        raise NotImplementedError(f"{type(self).__name__} is not batched")

    def observe(self, hidden: torch.Tensor) -> None:
        """The target's hidden states [n, k*C] of the rows its last forward committed (wants_hidden only)."""
        raise NotImplementedError(f"{type(self).__name__} does not read hidden states")


@dataclass
class ModelDrafter(Drafter):
    """Drafts with any engine (separate model, quantized self-draft, early exit) over a KV cache of its own.

    Invariant: `cache`'s committed rows hold the committed sequence minus `behind` (committed tokens it has not run
    yet) minus the root; `rows` maps tree nodes to the pending rows the last `propose` wrote.
    """

    # the draft model, stateless: one per runtime and draft, shared by every request's drafter, so the engine core
    # runs all their forwards of a depth as one batch
    engine: object
    sampling: SamplingConfig
    gen: torch.Generator
    # a self-draft (the target quantized, or its first layers) takes the target's prompt KV rows instead of running
    # the prompt itself: exact for early exit, close for a quantized copy; only draft quality depends on it
    share_prompt: bool = False
    cache: Rows | None = None  # its own draft KV rows (engine.make_cache; a later reset reuses them)
    behind: list[int] = field(default_factory=list)
    rows: dict[int, int] = field(default_factory=dict)  # tree node -> pending row (relative to cache.length)
    batched: ClassVar[bool] = True

    def reset(self, prompt_ids: list[int], max_len: int, rows: Rows | None = None) -> None:
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = self.engine.make_cache(max_len)
        self.cache.truncate(0)
        adopted = self.share_prompt and rows is not None and self.cache.adopt(rows, len(prompt_ids))
        if not adopted:
            prefill(self.engine, self.cache, prompt_ids)
        self.behind, self.rows = [], {}

    def propose(self, root: int, spec: SpecConfig) -> DraftTree:
        return drive([self.proposing(root, spec)])[0]

    def proposing(self, root: int, spec: SpecConfig) -> Proposing:
        base = self.cache.length
        run = self.behind + [root]  # catch up on committed tokens, then the root, as one causal chain
        logits = yield self.engine, chain_input(self.cache, run, (len(run) - 1,))  # [1, V]
        self.rows = {0: len(run) - 1}
        growing = grow_steps(root, logits, spec, self.sampling, self.gen)
        try:
            level, tokens, parents = next(growing)
            while True:
                logits = yield self.engine, self.level_input(level, tokens, parents, base)  # [len(level), V]
                level, tokens, parents = growing.send(logits)
        except StopIteration as done:
            return done.value

    def level_input(self, level: list[int], tokens: list[int], parents: list[int], base: int) -> SeqInput:
        """One depth of new nodes; each sees the committed prefix, the caught-up chain and its ancestors' rows."""
        pending = self.cache.pending
        mask, depth = level_mask(level, parents, self.rows, base, pending)  # [1, L, base + pending + L]
        return SeqInput(self.cache, tuple(tokens[n] for n in level),
                        tuple(base + self.rows[0] + d for d in depth), mask[0, :, base + pending:],
                        seen=mask[0, :, base:base + pending])

    def commit(self, tree: DraftTree, verdict: Verdict) -> None:
        if not self.rows:  # no proposal this step: the committed tokens are all still to run
            self.behind += [tree.tokens[i] for i in verdict.path]
            return
        kept = list(range(self.rows[0] + 1))  # caught-up tokens and the root
        ran = [i for i in verdict.path[1:] if i in self.rows]
        kept += [self.rows[i] for i in ran]
        self.cache.commit(kept)
        self.behind = [tree.tokens[i] for i in verdict.path[1 + len(ran):]]
        self.rows = {}


def level_mask(level: list[int], parents: list[int], rows: dict[int, int], base: int, pending: int
               ) -> tuple[torch.Tensor, list[int]]:
    """A draft depth's attention: the level's nodes get pending rows `pending + j` (recorded in `rows`: node -> row
    after `base` committed ones); each sees the committed rows, the chain up to the root's row rows[0], and its
    ancestors' rows. Returns (mask [1, L, base + pending + L], each node's depth)."""
    mask = torch.zeros(1, len(level), base + pending + len(level), dtype=torch.bool)
    mask[0, :, :base + rows[0]] = True  # committed rows + the caught-up chain before the root
    depth = []
    for j, node in enumerate(level):
        rows[node] = pending + j
        anc, d = node, 0
        while anc >= 0:
            if anc in rows:
                mask[0, j, base + rows[anc]] = True
            anc = parents[anc]
            d += 1
        depth.append(d - 1)
    return mask, depth


# a model drafter's proposal: yields (engine, SeqInput) per draft forward, is sent its logits, returns the tree
Proposing = Generator[tuple[object, SeqInput], torch.Tensor, DraftTree]


def drive(proposals: list[Proposing]) -> list[DraftTree]:
    """Run proposals together: each round, the forwards they ask of one engine run as ONE batched forward
    (`forward_batch`); a proposal that needs fewer depths finishes early. Returns their trees in order; raises the
    first proposal's error, if any (drive_each keeps the others)."""
    trees = drive_each(proposals)
    for t in trees:
        if isinstance(t, Exception):
            raise t
    return trees


def drive_each(proposals: list[Proposing]) -> list[DraftTree | Exception]:
    """`drive`, where a proposal that raises (or whose forward alone raises: engines.isolation) ends with its
    exception in its place and the others go on."""
    trees: list[DraftTree | Exception | None] = [None] * len(proposals)
    asks: dict[int, tuple[object, SeqInput]] = {}

    def advance(i: int, logits: torch.Tensor | None) -> None:
        try:
            asks[i] = proposals[i].send(logits)
        except StopIteration as done:
            trees[i] = done.value
        except Exception as e:  # noqa: BLE001 - this proposal's own failure
            trees[i] = e

    for i in range(len(proposals)):
        advance(i, None)
    while asks:
        current, groups = dict(asks), {}
        asks.clear()
        for i, (eng, seq) in current.items():
            groups.setdefault(id(eng), (eng, []))[1].append((i, seq))
        for eng, items in groups.values():
            for (i, _), logits in zip(items, forward_each(eng, [seq for _, seq in items])):
                if isinstance(logits, Exception):  # the proposal is left unfinished
                    trees[i] = logits
                else:
                    advance(i, logits)
    return trees


@dataclass
class NgramDrafter(Drafter):
    """Prompt lookup: continuations of the latest matches of the context's suffix (longest n first).

    An index of the context's n-grams (n = 1..max_n, start positions ascending) grows with every commit, so a
    proposal costs O(max_n + matches it reads), not a scan of the whole context."""

    max_n: int = 4
    min_n: int = 1  # shortest suffix worth matching
    context: list[int] = field(default_factory=list)
    index: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n-gram -> start positions, ascending

    def reset(self, prompt_ids: list[int], max_len: int, rows: Rows | None = None) -> None:
        self.context, self.index = [], {}
        self.extend(prompt_ids)

    def extend(self, tokens: list[int]) -> None:
        ctx = self.context
        for t in tokens:
            ctx.append(t)
            end = len(ctx)
            for n in range(1, min(self.max_n, end) + 1):
                self.index.setdefault(tuple(ctx[end - n:end]), []).append(end - n)

    def propose(self, root: int, spec: SpecConfig) -> DraftTree:
        conts, scores = self.continuations(root, spec.tree_depth, spec.tree_width)
        return trie(root, conts, spec.tree_budget, scores)

    def continuations(self, root: int, depth: int, width: int) -> tuple[list[list[int]], list[float]]:
        """Up to `width` distinct continuations (at most `depth` tokens) of the latest matches, longest suffix
        first; each with its matched suffix length / max_n."""
        ctx = self.context
        conts: list[list[int]] = []
        scores: list[float] = []
        for n in range(min(self.max_n, len(ctx)), self.min_n - 1, -1):
            suffix = (*ctx[len(ctx) - n + 1:], root)  # the last n tokens of context + root
            for i in reversed(self.index.get(suffix, ())):  # latest match first; it ends inside the context
                cont = ctx[i + n:i + n + depth]
                if len(cont) < depth and i + n + len(cont) == len(ctx):
                    cont.append(root)  # the continuation runs into the root itself
                if cont and not covered(conts, cont):
                    conts.append(cont)
                    scores.append(n / self.max_n)
                    if len(conts) >= width:
                        return conts, scores
        return conts, scores

    def commit(self, tree: DraftTree, verdict: Verdict) -> None:
        self.extend([tree.tokens[i] for i in verdict.path])


@dataclass
class HybridDrafter(Drafter):
    """Prompt lookup when the context repeats itself (a suffix of at least `ngram.min_n` tokens recurs: free and
    likely right), the model drafter otherwise. Both follow every commit."""

    ngram: NgramDrafter
    model: ModelDrafter
    model_spec: SpecConfig  # the model drafter's own tree shape
    batched: ClassVar[bool] = True

    def reset(self, prompt_ids: list[int], max_len: int, rows: Rows | None = None) -> None:
        self.ngram.reset(prompt_ids, max_len)
        self.model.reset(prompt_ids, max_len, rows)

    def propose(self, root: int, spec: SpecConfig) -> DraftTree:
        return drive([self.proposing(root, spec)])[0]

    def proposing(self, root: int, spec: SpecConfig) -> Proposing:
        tree = self.ngram.propose(root, spec)
        if len(tree) > 1:
            return tree
        return (yield from self.model.proposing(root, self.model_spec))

    def commit(self, tree: DraftTree, verdict: Verdict) -> None:
        self.ngram.commit(tree, verdict)
        self.model.commit(tree, verdict)  # without a proposal of its own this step, it catches up next time


@dataclass
class StoreDrafter(Drafter):
    """The request's own text first (prompt lookup), then the datastore of the target's own generations
    (datastore.py) for the forks the context leaves: continuations of the longest match of the recent tokens, most
    frequent first. Every node's score is its matched suffix length / max_n (until 2026-12-01 a store node's was
    its share of the matches: a store confidence head calibrated before then should be recalibrated)."""

    ngram: NgramDrafter
    store: Datastore

    def reset(self, prompt_ids: list[int], max_len: int, rows: Rows | None = None) -> None:
        self.ngram.reset(prompt_ids, max_len)

    def propose(self, root: int, spec: SpecConfig) -> DraftTree:
        conts, scores = self.ngram.continuations(root, spec.tree_depth, spec.tree_width)
        if len(conts) < spec.tree_width:
            ctx = self.ngram.context
            query = [*ctx[max(0, len(ctx) - KEY + 1):], root]  # [<= KEY]
            # a store node's score is its matched suffix length / max_n, as a context node's (the longer the
            # match, the likelier the node: the scheduler's odds and the verifier's head read it)
            match = self.store.longest(query)
            score = min(match[0], self.ngram.max_n) / self.ngram.max_n
            for cont, _share in self.store.continuations_of(match, spec.tree_depth, spec.tree_width):
                if not covered(conts, cont):
                    conts.append(cont)
                    scores.append(score)
                    if len(conts) == spec.tree_width:
                        break
        return trie(root, conts, spec.tree_budget, scores)

    def commit(self, tree: DraftTree, verdict: Verdict) -> None:
        self.ngram.commit(tree, verdict)


def trie(root: int, continuations: list[list[int]], budget: int, scores: list[float] | None = None) -> DraftTree:
    """Merge token sequences into a tree under `root` (shared prefixes share nodes), at most `budget` draft nodes.
    A node's score is that of the first continuation through it (the best match: they come best first)."""
    tokens, parents, node_scores = [root], [-1], [1.0]
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for c, cont in enumerate(continuations):
        node = 0
        for t in cont:
            if (node, t) not in index:
                if len(tokens) - 1 >= budget:
                    break
                index[(node, t)] = len(tokens)
                tokens.append(t)
                parents.append(node)
                node_scores.append(scores[c] if scores else 1.0)
            node = index[(node, t)]
    return DraftTree(tuple(tokens), tuple(parents), score=tuple(node_scores))
