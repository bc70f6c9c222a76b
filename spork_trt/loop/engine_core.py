"""The engine core: every active request stepped together (continuous batching) over one preallocated KV pool.

One `step()`: admit waiting requests into free slots; each decoding request's drafter proposes a tree, the verifier
scores it, and the scheduler's goodput allotment (scheduler.allot) decides across ALL requests which nodes ONE
target forward verifies; then per request: verify, commit, stream (into its outbox), recover. Prompts are
prefilled in chunks that ride in that same forward: one token budget (`step_tokens`) holds every request's root,
then the joining prompts' chunks, then the allotted nodes, so a long prompt never stalls the others and a step
pays one forward's fixed cost (a padded engine, whose batch costs B x T, runs the chunks in a second forward:
`chunks_apart`).
Requests join and leave between steps; a cancelled one leaves at the next step and frees its slot. `generate`
(generate.py) is this core with a batch of one: one code path for the CLI, the bench and the server.

The caller submits a frozen `Submission` (`add`) and gets back the `Request` the core keeps of it (request.py). The
core never calls back into its caller: the request's cancellation is the one field the caller sets and the core
reads; its new tokens, stats and result are fields the caller reads after each step (`step` returns the requests
that finished in it).

A request fails alone: whatever raises in the work of one request (its proposal, scoring, tree, verification,
commit, prefill) fails that request (`error`, the detail logged under its `id`) and the others go on in the same
step; a batched forward that raises is run again sequence by sequence (engines.isolation), so only the requests
whose own forward raises fail.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spork_trt.loop.admission import size_request
from spork_trt.config import GenerateConfig
from spork_trt.spec.cost_model import CostModel
from spork_trt.spec.draft_switch import DraftSwitch
from spork_trt.spec.drafters import drive_each
from spork_trt.engines import SeqInput, chain_input
from spork_trt.engines.isolation import forward_each
from spork_trt.errors import QueueFull
from spork_trt.engines.kv_cache import KVPool
from spork_trt.loop.prefix_cache import PrefixCache
from spork_trt.spec.sampling import make_generator, pick, processed_probs
from spork_trt.spec.scheduler import Candidates, Scheduler, allot
from spork_trt.loop.step_records import Draft, Forward, Plan, TreeWork
from spork_trt.loop.stats import Stats
from spork_trt.loop.stopping import StopState
from spork_trt.loop.request import Request, Submission, Verified, emit, wants_hidden
from spork_trt.spec.tree import DraftTree, compile_tree
from spork_trt.spec.verifier import Scored, ScoreJob, gate_path, score_batch
from spork_trt.spec.grammar import with_chain
from spork_trt.spec.logprobs import certain
from spork_trt.spec.verification import Verdict, verify_greedy, verify_sampling

log = logging.getLogger("spork_trt.loop.engine_core")
MAX_JUMP = 16  # forced tokens committed after one step (they ride in the next forward, beyond its tree allotment)


@dataclass(frozen=True)
class CoreConfig:
    slots: int = 1  # requests decoded at once (KV pool slots)
    max_len: int = 2048  # positions per slot: prompt + new tokens + a draft tree's room
    step_tokens: int = 384  # most tokens of a step's forward: every request's root, then prompt chunks, then nodes
    prefill_tokens: int = 128  # most prompt tokens a step prefills (all joining requests together)
    max_queue: int = 64  # requests waiting for a slot; more are refused (QueueFull)
    prefix_reuse: bool = True  # a prompt starting with a finished or running request's rows reuses them (prefix_cache)


class EngineCore:
    def __init__(self, engine, context: int, cfg: CoreConfig = CoreConfig()) -> None:
        self.engine, self.context, self.cfg = engine, context, cfg  # engine: stateless over the pool's slots
        self.pool: KVPool = engine.make_pool(cfg.slots, cfg.max_len)
        self.prefixes = PrefixCache(self.pool)  # the free slots and the committed rows they still hold
        self.costs = CostModel()  # target forward seconds by tokens, shared by every request's scheduler
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []
        self.batch_tokens = 0  # tokens of the last target forward (a metric)
        self.switch = DraftSwitch()  # whether a step proposes at all, measured per batch size
        # per drafter: acceptance odds by ([source,] depth, rank[, strength]) pooled over its requests
        # (Scheduler.odds): a request of 128 tokens sees too few verdicts to learn them alone (its estimates stayed
        # near the 0.5 prior, about twice what the store's nodes are accepted at); shared, the allotment's
        # expectations match
        self.odds: dict[str, dict] = {}

    def add(self, sub: Submission, stats: Stats | None = None) -> Request:
        """Queue a submission (validated here: bad input raises UserError, a full queue QueueFull); returns the
        core's state of it, the Request the caller reads after each step and may cancel. `stats`, when given, is
        the one the request fills in place (a caller reading progress from it); else a new one."""
        size = size_request(len(sub.prompt_ids), sub.cfg.max_new_tokens, sub.spec, self.context, self.pool.max_len)
        if len(self.waiting) >= self.cfg.max_queue + len(self.pool.free):  # free slots take them at the next step
            raise QueueFull(f"all {self.pool.slots} slots are in use and {self.cfg.max_queue} requests wait for one "
                            f"(max_queue): retry later")
        r = Request(sub, stats=Stats() if stats is None else stats, room=size.room, t0=time.perf_counter(),
                    stop=StopState(sub.eos_ids, size.max_new, sub.cfg.stop_strings, sub.decode),
                    sched=Scheduler(sub.spec, greedy=sub.cfg.greedy, costs=self.costs,
                                    odds=self.odds.setdefault(sub.spec.draft, {})),
                    gen=make_generator(sub.cfg.sampling.seed))
        self.waiting.append(r)
        return r

    @property
    def idle(self) -> bool:
        return not self.active and not self.waiting

    def step(self) -> list[Request]:
        """One step over every active request; returns the requests that finished (or left, or failed) in it."""
        done = self.retire([r for r in (*self.waiting, *self.active) if r.cancelled])
        self.admit()
        decoding = [r for r in self.active if r.root is not None]
        # the switch decides (and learns from) only steps with a greedy request that would follow it
        switched = any(r.sub.drafter is not None and r.sub.cfg.greedy for r in decoding)
        t0, drafting = time.perf_counter(), switched and self.switch.propose(len(decoding))
        drafts = self.propose(decoding, drafting)  # a request whose proposal raised is not among them: it failed
        chunks = self.chunks([r for r in self.active if r.root is None], self.cfg.step_tokens - len(drafts))
        trees = self.trees(drafts, sum(len(c.tokens) for c in chunks.values()))
        out = self.forward({r: w.seq for r, w in trees.items()}, chunks)
        verifying = [r for r, d in drafts.items() if d.gated or r in out.logits]
        committed = sum(self.each(verifying, lambda r: self.commit(r, drafts[r], trees.get(r), out.logits.get(r),
                                                                   out.tree_s, out.features.get(r))).values())
        if switched:
            self.switch.record(len(decoding), drafting, committed, time.perf_counter() - t0 - out.prefill_s)
        self.each([r for r in chunks if r in out.logits],
                  lambda r: self.prefilled(r, len(chunks[r].tokens), out.logits[r], out.features.get(r)))
        return done + self.retire([r for r in self.active if r.error is not None or r.stop.reason is not None])

    def abort(self, e: Exception) -> list[Request]:
        """After a step raised outside any one request's work (their state unknown): every active request fails
        with `e` and leaves, slot freed; the waiting ones stay. Returns the ones that left."""
        failed = list(self.active)
        log.error("a step failed outside any one request's work: its requests %s fail",
                  ", ".join(r.sub.id for r in failed) or "(none)")
        for r in failed:
            r.error = e
        return self.retire(failed)

    def each(self, reqs: list[Request], work: Callable[[Request], object]) -> dict[Request, object]:
        """work(r) for each request, by request; one that raises fails alone and is left out."""
        out = {}
        for r in reqs:
            try:
                out[r] = work(r)
            except Exception as e:  # noqa: BLE001 - whatever it is, it is this request's
                self.fail(r, e)
        return out

    def fail(self, r: Request, e: Exception) -> None:
        """Fail one request alone: it leaves at the end of this step; the detail goes to the log, under its id."""
        log.error("request %s failed; it leaves the batch, the others go on", r.sub.id, exc_info=e)
        r.error = e

    def forward(self, trees: dict[Request, SeqInput], chunks: dict[Request, SeqInput]) -> Forward:
        """ONE target forward over the decoding requests' trees and the joining requests' prompt chunks. A padded
        engine (a batch costs it B x T: a prompt chunk would pad every tree to the chunk's length) runs the chunks
        in a second forward. Each forward's seconds teach the cost model; the trees' share of them (by the cost
        model's price of their tokens) is what verifying cost."""
        padded = self.engine.padded_batches
        logits, features, tree_s, prefill_s = {}, {}, 0.0, 0.0
        for seqs in ([trees, chunks] if self.engine.chunks_apart else [trees | chunks]):
            if not seqs:
                continue
            t = time.perf_counter()
            got, feats = self.run(seqs)
            s, sizes = time.perf_counter() - t, [len(q.tokens) for q in seqs.values()]
            self.batch_tokens = sum(sizes)
            self.costs.record(len(sizes) * max(sizes) if padded else self.batch_tokens, s)
            n = sum(len(q.tokens) for r, q in seqs.items() if r in trees)  # the trees' tokens of this forward
            share = self.costs.seconds(n) / self.costs.seconds(self.batch_tokens) if 0 < n < self.batch_tokens \
                else float(n > 0)
            tree_s, prefill_s = tree_s + s * share, prefill_s + s * (1 - share)
            logits, features = logits | got, features | feats
        return Forward(logits, features, tree_s, prefill_s)

    def run(self, seqs: dict[Request, SeqInput]) -> tuple[dict, dict]:
        """engine.forward_batch over the requests' sequences -> their logits [r_b, V] and, for those whose drafter
        wants them, hidden states [n_b, k*C], by request; a request whose own forward raises fails and is left
        out (engines.isolation)."""
        hidden = [] if any(wants_hidden(r) for r in seqs) else None
        logits, features = {}, {}
        for i, (r, out) in enumerate(zip(seqs, forward_each(self.engine, list(seqs.values()), hidden))):
            if isinstance(out, Exception):
                self.fail(r, out)
                continue
            logits[r] = out
            if hidden is not None and wants_hidden(r):
                features[r] = hidden[i]
        return logits, features

    def admit(self) -> None:
        """Waiting requests into free slots, oldest first; one whose prompt starts with the rows a slot kept
        prefills only the rest (a drafter fed the target's hidden states needs every row's: it prefills all)."""
        while self.waiting and self.pool.free:
            r = self.waiting[0]
            reuse = self.cfg.prefix_reuse and not wants_hidden(r)
            scope = r.sub.cache_scope
            taken = self.prefixes.take(r.sub.prompt_ids, reuse=reuse, scope=scope)
            if reuse:  # a running request may hold more of the prompt than any kept slot: its rows are copied
                taken = self.prefixes.share(taken, r.sub.prompt_ids, {
                    a.slot: (*a.sub.prompt_ids, *a.stop.tokens) for a in self.active if a.sub.cache_scope == scope})
            self.waiting.popleft()
            r.slot, r.cache = taken.slot, self.pool.caches[taken.slot]
            r.prefilled = r.stats.cached_tokens = taken.reused
            self.active.append(r)

    def retire(self, leaving: list[Request]) -> list[Request]:
        now = time.perf_counter()
        for r in leaving:
            if r in self.waiting:
                self.waiting.remove(r)
            else:
                self.active.remove(r)
                # what the target ran, kept for a later prompt that starts with it (nothing of a failed request)
                self.prefixes.give_back(r.slot, [] if r.error else [*r.sub.prompt_ids, *r.stop.tokens],
                                        r.sub.cache_scope)
                r.slot, r.cache = None, None
            st, sc = r.stats, r.sched
            st.time_s, st.fallbacks, st.pruned_tokens, st.verifier_offs = now - r.t0, sc.fallbacks, sc.pruned, \
                sc.verifier.offs
            st.grammar_s = r.sub.constraint.spent_s if r.sub.constraint is not None else 0.0
            r.finished = True
        return leaving

    def propose(self, reqs: list[Request], drafting: bool = True) -> dict[Request, Draft]:
        """Each request's drafter proposes; the trees the verifier scores run through ONE verifier forward
        (verifier.score_batch; its time shared among them); then each request's candidates for the allotment.
        `drafting`: the draft switch's choice for this step; a sampled request ignores it (its seeded draws depend
        on its trees, so they must not depend on timing or on the other requests). A request that fails in any of
        it is left out."""
        plans = self.plan(reqs, drafting)
        scores: dict[Request, Scored] = {}
        groups: dict[int, list[Request]] = {}  # by verifier engine (a runtime's requests share one)
        for r, p in plans.items():
            if p.scoring:
                groups.setdefault(id(r.sub.verifier.engine), []).append(r)
        t = time.perf_counter()
        for group in groups.values():
            scores.update(self.score(group, plans))
        score_s = (time.perf_counter() - t) / max(len(scores), 1)
        return self.each([r for r, p in plans.items() if r in scores or not p.scoring],
                         lambda r: self.draft(r, plans[r], scores.get(r), score_s))

    def score(self, reqs: list[Request], plans: dict[Request, Plan]) -> dict[Request, Scored]:
        """The requests' trees scored in ONE verifier forward; if it raises, each alone (its rows dropped first),
        so only a request whose own scoring raises fails."""
        def job(r: Request) -> ScoreJob:
            return ScoreJob(r.sub.verifier, r.cache, r.behind, plans[r].proposed, r.sched.recent,
                            [*r.sub.prompt_ids, *r.stop.tokens], len(r.sub.prompt_ids))

        try:
            return dict(zip(reqs, score_batch([job(r) for r in reqs])))
        except Exception as e:  # noqa: BLE001 - any failure: find the requests it belongs to
            log.warning("scoring %d requests' trees together failed (%r): scoring each alone", len(reqs), e)
        for r in reqs:
            r.cache.forget(0)  # the verifier's rows; the target's own pending none (score_batch's contract)
        return self.each(reqs, lambda r: score_batch([job(r)])[0])

    def plan(self, reqs: list[Request], drafting: bool) -> dict[Request, Plan]:
        """Each request's proposal. Model drafters (`proposing`) run together: each draft depth of every request is
        ONE batched forward of the draft engine (drafters.drive_each; its time shared among them); the others
        propose one by one. A request whose proposal raises fails and is left out."""
        speculate = self.each(reqs, lambda r: (drafting or not r.sub.cfg.greedy) and r.sub.drafter is not None
                              and r.sched.speculate())
        trees, seconds = {}, {}
        for r, sp in speculate.items():
            if sp and not r.sub.drafter.batched:
                t = time.perf_counter()
                trees.update(self.each([r], lambda r: r.sub.drafter.propose(r.root, r.sched.shape())))
                seconds[r] = time.perf_counter() - t
        batched = list(self.each([r for r, sp in speculate.items() if sp and r.sub.drafter.batched],
                                 lambda r: r.sub.drafter.proposing(r.root, r.sched.shape())).items())
        t = time.perf_counter()
        for (r, _), tree in zip(batched, drive_each([p for _, p in batched])):
            if isinstance(tree, Exception):
                self.fail(r, tree)
            else:
                trees[r] = tree
        seconds.update(dict.fromkeys((r for r, _ in batched), (time.perf_counter() - t) / max(len(batched), 1)))
        return self.each([r for r, sp in speculate.items() if r in trees or not sp],
                         lambda r: self.plan_of(r, speculate[r], trees.get(r), seconds.get(r, 0.0)))

    def plan_of(self, r: Request, speculate: bool, tree: DraftTree | None, seconds: float) -> Plan:
        if tree is not None and r.sub.constraint is not None and not wants_hidden(r):
            tree = with_chain(tree, r.sub.constraint, MAX_JUMP)  # the grammar's forced text: a free draft
        scoring = speculate and (r.sub.cfg.greedy or r.sub.spec.gate_tau > 0) and r.sched.verifier.use(r.can_score)
        return Plan(tree if speculate else DraftTree.root_only(r.root), speculate, scoring, seconds)

    def draft(self, r: Request, p: Plan, scored: Scored | None, score_s: float) -> Draft:
        gated = gate_path(p.proposed, scored, r.sub.spec.gate_tau) if r.sub.spec.gate_tau > 0 and scored else []
        survival = None if scored is None else scored.survival
        cands = None if gated else r.sched.candidates(p.proposed, r.sub.cfg.greedy, survival)
        return Draft(p.proposed, scored, gated, cands, p.speculate, p.propose_s, score_s if scored else 0.0)

    def tree_work(self, r: Request, d: Draft, count: int) -> TreeWork:
        keep, masks = r.sched.kept(d.proposed, d.cands, count), None
        tree = d.proposed.subtree(keep)
        if r.sub.constraint is not None:  # nodes the grammar forbids where they stand are cut before the forward
            valid, masks = r.sub.constraint.tree_masks(tree)  # the kept nodes only (each one's ancestors are kept)
            rows = [i for i, ok in enumerate(valid) if ok]
            keep, masks = [keep[i] for i in rows], masks[rows]  # [N, W]
            tree = d.proposed.subtree(keep)
        b, buf = len(r.behind), compile_tree(tree.after(r.behind).parents, r.cache.length)
        children = tuple(tuple(c - b for c in ch) for ch in buf.children[b:])
        seq = SeqInput(r.cache, (*r.behind, *tree.tokens), tuple(buf.position_ids[0].tolist()), buf.ancestors)
        return TreeWork(keep, tree, children, seq, masks)

    def commit(self, r: Request, d: Draft, work: TreeWork | None, logits: torch.Tensor | None,
               verify_s: float, hidden: torch.Tensor | None = None) -> int:
        """Verify one request's tree against its logits [len(behind) + N, V], commit, stream, recover; returns the
        tokens committed. `hidden` [len(behind) + N, k*C]: the target's hidden states there, for a drafter that
        wants them."""
        t = time.perf_counter()
        if d.gated:  # lossy gate mode: the verifier alone accepts; the target runs these tokens in its next pass
            keep, tree = list(range(len(d.proposed))), d.proposed
            path = d.gated
            verdict = Verdict((0, *path[:-1]), tuple(tree.tokens[i] for i in path[:-1]), tree.tokens[path[-1]])
            r.behind += [tree.tokens[i] for i in verdict.path]
        else:
            b, keep, tree = len(r.behind), work.keep, work.tree
            at = logits[b:] if work.masks is None else r.sub.constraint.constrain(logits[b:], work.masks)  # [N, V]
            verdict = verify(tree, work.children, at, r.sub.cfg, r.gen)
            kept_rows = list(range(b)) + [b + i for i in verdict.path]
            r.cache.commit(kept_rows)
            if hidden is not None:
                r.sub.drafter.observe(hidden[kept_rows])  # [committed rows, k*C]
            r.behind = []
        if r.sub.drafter is not None:
            r.sub.drafter.commit(d.proposed, verdict.renumber(keep))
        verify_s += time.perf_counter() - t
        r.stats.add_times(d.propose_s, d.score_s, verify_s, d.scored is not None)
        if not d.gated:
            if r.sub.record:
                r.verified.append(Verified(d.proposed, d.scored, verdict.renumber(keep)))
            r.sched.record(tree, verdict, d.speculated, d.propose_s + d.score_s, verify_s,
                           d.score_s if d.scored is not None else None, d.proposed)
        r.root = verdict.bonus
        if r.sub.constraint is not None:
            r.sub.constraint.advance([*verdict.accepted, r.root])
        emit(r, [*verdict.accepted, r.root], draft=0 if d.gated else len(tree) - 1,
             accepted=0 if d.gated else len(verdict.accepted), gated=len(d.gated),
             rows=None if d.gated else at[list(verdict.path)])  # the path's rows predicted accepted + bonus
        return len(verdict.accepted) + 1 + self.jump(r)

    def jump(self, r: Request) -> int:
        """Jump-forward: the tokens the request's grammar allows alone after its root are committed now, without a
        verdict (the masked target could give no other): the root and all but the last become `behind` (the next
        forward runs them ahead of the tree), the last the new root; the drafter follows them as one accepted
        chain. Speculating requests only (plain decoding stays the reference). Returns the tokens committed."""
        if r.sub.constraint is None or r.sub.drafter is None or r.stop.reason is not None or wants_hidden(r):
            return 0  # a drafter reading the target's hidden states needs them for every committed row: not here
        left = r.sub.cfg.max_new_tokens - len(r.stop.tokens)
        forced = r.sub.constraint.forced(min(MAX_JUMP, left), r.sub.eos_ids)
        if not forced:
            return 0
        chain = DraftTree((r.root, *forced), tuple(range(-1, len(forced))))
        r.sub.drafter.commit(chain, Verdict(tuple(range(len(forced))), tuple(forced[:-1]), forced[-1]))
        r.behind += [r.root, *forced[:-1]]
        r.root = forced[-1]
        r.sub.constraint.advance(forced)
        r.stats.forced_tokens += len(forced)
        emit(r, forced, draft=0, accepted=0, rows=certain(forced, r.sub.constraint.vocab_size), step=False)
        return len(forced)

    def chunks(self, joining: list[Request], room: int) -> dict[Request, SeqInput]:
        """The next chunk of joining requests' prompts (oldest first, `prefill_tokens` in all, at most `room` and at
        least one token): they ride in the step's forward; a prompt's last chunk asks for its last row's logits."""
        left, chunks = min(self.cfg.prefill_tokens, max(room, 1)), {}
        for r in joining:
            n = min(len(r.sub.prompt_ids) - r.prefilled, left)
            if n <= 0:
                break
            last = r.prefilled + n == len(r.sub.prompt_ids)
            chunks |= self.each([r], lambda r: chain_input(r.cache, r.sub.prompt_ids[r.prefilled:r.prefilled + n],
                                                           (n - 1,) if last else ()))
            left -= n
        return chunks

    def trees(self, drafts: dict[Request, Draft], prefill: int) -> dict[Request, TreeWork]:
        """Each decoding request's tree cut to its share of the goodput allotment across all of them
        (scheduler.allot), within the step's tokens left by `prefill` prompt tokens and priced as riding on them."""
        padded = self.engine.padded_batches
        seconds = self.costs.seconds if self.engine.chunks_apart or not prefill else (
            lambda n: self.costs.seconds(n + prefill))
        counts = dict(zip(drafts, allot([d.cands or Candidates((), ()) for d in drafts.values()], seconds,
                                        self.cfg.step_tokens - prefill, padded)))
        self.switch.allotted([counts[r] for r, d in drafts.items() if d.cands is not None and d.cands.order])
        return self.each([r for r, d in drafts.items() if not d.gated],
                         lambda r: self.tree_work(r, drafts[r], counts[r]))

    def prefilled(self, r: Request, n: int, logits: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """After a prompt chunk of `n` tokens ran (logits [1 or 0, V]; hidden [n, k*C] for a drafter that wants
        them): keep its rows; after the last chunk, the first token."""
        r.cache.commit()
        if hidden is not None:
            r.sub.drafter.observe(hidden)  # the chunk's [n, k*C]: its reset takes the whole prompt's
        r.prefilled += n
        if r.prefilled < len(r.sub.prompt_ids):
            return
        c = r.sub.constraint
        last = logits[-1:] if c is None else c.constrain(logits[-1:], c.next_mask())
        r.root = pick(last[0], r.sub.cfg.sampling, r.gen)
        if r.sub.constraint is not None:
            r.sub.constraint.advance([r.root])
        if r.sub.drafter is not None:
            r.sub.drafter.reset(r.sub.prompt_ids, r.room + r.sub.spec.tree_depth, r.cache)
        r.stats.prefill_s = time.perf_counter() - r.t0
        emit(r, [r.root], draft=0, accepted=0, rows=last)
        self.jump(r)


def verify(tree: DraftTree, children, logits: torch.Tensor, cfg: GenerateConfig, gen: torch.Generator) -> Verdict:
    """logits [N, V] on the engine's device: greedy takes their argmax there (N ids cross to the host); sampling
    processes them there and walks the tree on the host (the drafts' proposals and `gen` live there)."""
    if cfg.greedy:
        return verify_greedy(tree, children, logits)
    return verify_sampling(tree, children, processed_probs(logits, cfg.sampling).cpu(), gen)
