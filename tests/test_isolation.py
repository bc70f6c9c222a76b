"""A request that fails fails alone (issue 38, isolation): on tiny seeded random models, whatever raises in one
request's work (its drafter, its forward) fails that request, with its id and no internal text for the client,
while the others finish with exactly the tokens they get alone; a batched forward that raises once is run again
and changes nothing; a step that raises outside any one request fails its requests, not the waiting ones; and when
the service's loop thread dies anyway, the service says so and refuses every request at once (UNAVAILABLE)."""
from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest

from spork_trt.config import GenerateConfig, SamplingConfig, SpecConfig
from spork_trt.loop.engine_core import CoreConfig, EngineCore
from spork_trt.spec.drafters import ModelDrafter, NgramDrafter
from spork_trt.engines.torch_engine import TorchEngine
from spork_trt.errors import InternalError, QueueFull
from spork_trt.loop.generate import generate
from spork_trt.loop.request import Submission
from spork_trt.spec.sampling import make_generator
from spork_trt.serving.engine_service import Service
from spork_trt.checkpoint.weights import random_checkpoint
from tests.conftest import core_requests, tiny_config

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3], [9] * 12 + [4, 9, 9], [30, 31, 32, 33, 30, 31]]
NEW = 20


class Broken(RuntimeError):
    """An internal failure whose text must never reach a client."""


SECRET = "secret internal detail"


@pytest.fixture(scope="module")
def model():
    return random_checkpoint(tiny_config(), seed=5, scale=8.0).model


def alone(model, i: int) -> list[int]:
    return generate(TorchEngine(model), PROMPTS[i], GenerateConfig(max_new_tokens=NEW), frozenset()).token_ids


class FailingNgram(NgramDrafter):
    def propose(self, root, spec):
        raise Broken(SECRET)


class FailingModelDrafter(ModelDrafter):
    def proposing(self, root, spec):
        yield from ()
        raise Broken(SECRET)


def ngram_request(i: int, drafter=None) -> Submission:
    return Submission(PROMPTS[i], GenerateConfig(max_new_tokens=NEW), frozenset(), SpecConfig.for_draft("ngram"),
                      drafter or NgramDrafter(4))


def early_request(i: int, engine, cls=ModelDrafter) -> Submission:
    drafter = cls(engine, SamplingConfig(), make_generator(None))  # engine: the draft engine the drafters share
    return Submission(PROMPTS[i], GenerateConfig(max_new_tokens=NEW), frozenset(),
                      SpecConfig.for_draft("early-exit", adaptive=False), drafter)


def test_a_drafter_that_raises_fails_its_request_alone(model):
    """One request's n-gram drafter and one's model drafter (batched with another's: drafters.drive_each) raise;
    those two fail with their error, the three others finish with the tokens they get alone, slots come back."""
    early = TorchEngine(model, exit_layer=1)
    subs = [ngram_request(0), ngram_request(1, FailingNgram(4)), early_request(2, early),
            early_request(3, early, FailingModelDrafter), Submission(PROMPTS[1], GenerateConfig(
                max_new_tokens=NEW), frozenset())]
    core = EngineCore(TorchEngine(model), 256, CoreConfig(slots=5, max_len=96))
    reqs = core_requests(core, subs)
    out = [r.result() for r in reqs]
    assert [out[i].stop_reason for i in (1, 3)] == ["error", "error"]
    assert isinstance(reqs[1].error, Broken) and isinstance(reqs[3].error, Broken)
    assert [out[i].token_ids for i in (0, 2, 4)] == [alone(model, 0), alone(model, 2), alone(model, 1)]
    assert reqs[2].stats.draft_tokens > 0 and core.pool.in_use == 0 and core.idle


class Flaky(TorchEngine):
    """A target whose batched forward raises: once, the first batch of several prompt chunks (`fail` "prefill") or
    decoding trees ("tree"), after storing its rows; always, a batch holding a sequence of a `poisoned` cache."""

    def __init__(self, model, fail: str = "", exit_layer: int | None = None) -> None:
        super().__init__(model, exit_layer)
        self.fail, self.failed, self.poisoned = fail, False, set()

    def forward_batch(self, seqs, hidden=None):
        if any(id(s.cache) in self.poisoned for s in seqs):
            raise Broken(SECRET)
        trees = all(s.logit_rows is None for s in seqs)  # a prompt chunk asks for its last row's logits or none
        if len(seqs) > 1 and not self.failed and self.fail == ("tree" if trees else "prefill"):
            self.failed = True
            for s in seqs:  # as a forward that stored its rows before it failed
                s.cache.written(len(s.tokens))
            raise Broken(SECRET)
        return super().forward_batch(seqs, hidden)


@pytest.mark.parametrize("fail", ["prefill", "tree"])
def test_a_batched_forward_that_raises_once_is_run_again_and_changes_nothing(model, fail):
    eng = Flaky(model, fail)
    core = EngineCore(eng, 256, CoreConfig(slots=4, max_len=96, prefill_tokens=5))
    reqs = core_requests(core, [ngram_request(i) for i in range(4)])
    out = [r.result() for r in reqs]
    assert eng.failed and all(r.error is None for r in reqs)
    assert [out[i].token_ids for i in range(4)] == [alone(model, i) for i in range(4)]


def test_a_forward_that_keeps_raising_for_one_request_fails_it_alone(model):
    eng = Flaky(model)
    core = EngineCore(eng, 256, CoreConfig(slots=3, max_len=96))
    reqs = [core.add(ngram_request(i)) for i in range(3)]
    core.step()  # admitted and prefilled: each holds its slot's cache
    eng.poisoned.add(id(reqs[1].cache))
    while not core.idle:
        core.step()
    assert isinstance(reqs[1].error, Broken) and reqs[1].result().stop_reason == "error" and core.pool.in_use == 0
    assert [reqs[i].result().token_ids for i in (0, 2)] == [alone(model, 0), alone(model, 2)]


def test_a_draft_forward_that_keeps_raising_for_one_drafter_fails_its_request_alone(model):
    """Two model drafters batched on one draft engine (drafters.drive_each): the forwards of one's cache raise."""
    early = Flaky(model, exit_layer=1)
    core = EngineCore(TorchEngine(model), 256, CoreConfig(slots=2, max_len=96))
    reqs = [core.add(early_request(i, early)) for i in (0, 2)]
    core.step()  # prefilled: each drafter holds its own cache
    early.poisoned.add(id(reqs[0].sub.drafter.cache))
    while not core.idle:
        core.step()
    assert isinstance(reqs[0].error, Broken) and reqs[1].error is None and core.pool.in_use == 0
    assert reqs[1].result().token_ids == alone(model, 2) and reqs[1].stats.draft_tokens > 0


# ---- the service


@pytest.fixture(scope="module")
def runtime(model):
    from spork_trt.loop.runtime import Runtime
    from spork_trt.checkpoint.tokenizer import load_tokenizer
    from spork_trt.checkpoint.weights import default_gguf_path

    return Runtime(model.cfg, load_tokenizer(default_gguf_path(), "gguf"), TorchEngine(model), lambda d: None)


def inputs(i: int) -> dict:
    return {"input_ids": np.array([PROMPTS[i]], np.int32), "max_tokens": np.array([[NEW]], np.int32)}


class Answer:
    """One submitted request's answer: its chunks, or its error."""

    def __init__(self) -> None:
        self.chunks, self.error, self.done = [], None, threading.Event()

    def send(self, chunk) -> None:
        self.chunks.append(chunk)
        if chunk.final:
            self.done.set()

    def fail(self, e: BaseException) -> None:
        self.error = e
        self.done.set()

    def text(self, runtime) -> str:
        assert self.done.wait(60) and self.error is None, self.error
        return runtime.tokenizer.decode([t for c in self.chunks for t in c.output_ids[c.sent_len:]])


def submit(service: Service, i: int, **kw) -> Answer:
    a = Answer()
    service.submit(inputs(i), a.send, a.fail, **kw)
    return a


def plain_text(runtime, model, i: int) -> str:
    """Plain greedy decoding's text, on an engine of its own (the service's thread steps the runtime's)."""
    tok = runtime.tokenizer
    return generate(TorchEngine(model), PROMPTS[i], GenerateConfig(max_new_tokens=NEW), tok.eos_ids, tok.decode).text


def client_safe(e: BaseException) -> str:
    """The failed request's answer names its id, never the internal exception."""
    assert isinstance(e, InternalError) and e.request_id in str(e)
    assert SECRET not in str(e) and "Broken" not in str(e)
    return e.request_id


def test_a_failing_drafter_fails_its_request_alone_with_an_id_the_log_names(runtime, model, monkeypatch, caplog):
    real = runtime.request

    def request(prompt_ids, *a, **kw):  # the request of prompt 1 gets a drafter that raises
        sub = real(prompt_ids, *a, **kw)
        return replace(sub, drafter=FailingNgram(4)) if prompt_ids == PROMPTS[1] else sub

    monkeypatch.setattr(runtime, "request", request)
    service = Service(runtime, SpecConfig.for_draft("ngram"), CoreConfig(slots=2, max_len=96))
    try:
        good, bad = submit(service, 0), submit(service, 1)
        assert good.text(runtime) == plain_text(runtime, model, 0)
        assert bad.done.wait(60) and not bad.chunks
        rid = client_safe(bad.error)
        assert any(rid in r.getMessage() and r.exc_info and SECRET in str(r.exc_info[1]) for r in caplog.records)
        assert service.healthy and service.active == 0
    finally:
        service.close()


def test_a_step_that_raises_fails_its_requests_not_the_waiting_ones(runtime, model, monkeypatch):
    service = Service(runtime, SpecConfig.for_draft("ngram"), CoreConfig(slots=1, max_len=96))
    core, real, calls = service.core, service.core.step, []

    def step():  # the second step raises outside any one request's work: request 0 holds the slot, 1 waits
        calls.append(1)
        if len(calls) == 2:
            raise Broken(SECRET)
        return real()

    monkeypatch.setattr(core, "step", step)
    try:
        first, second = submit(service, 0), submit(service, 1)
        assert second.text(runtime) == plain_text(runtime, model, 1)
        assert first.done.wait(60) and first.error is not None
        client_safe(first.error)
        assert service.healthy and core.pool.in_use == 0
        assert submit(service, 2).text(runtime) == plain_text(runtime, model, 2)  # and it goes on serving
    finally:
        service.close()


def test_when_the_loop_thread_dies_the_service_is_unhealthy_and_refuses_at_once(runtime):
    service = Service(runtime, SpecConfig.for_draft("ngram"), CoreConfig(slots=2, max_len=96))
    try:
        def cancelled():  # the loop asks it outside the core's step; no Exception guard catches this
            raise SystemExit("the loop thread dies")

        dying = submit(service, 0, cancelled=cancelled)
        assert dying.done.wait(10) and isinstance(dying.error, QueueFull)  # answered, not left hanging
        assert not service.healthy and service.metrics.loop_up == 0
        with pytest.raises(QueueFull, match="engine loop stopped"):
            submit(service, 1)
        assert service.active == 0
    finally:
        service.close()


def test_a_client_sees_bad_input_and_a_full_server_as_they_are_anything_else_by_id_only(caplog):
    from spork_trt.errors import UserError
    from spork_trt.serving.engine_service import public_error

    for e in (UserError("max_tokens must be positive"), QueueFull("retry later"), InternalError("abc")):
        assert public_error(e) is e
    rid = client_safe(public_error(Broken(SECRET), "r42"))
    assert rid == "r42" and any("r42" in r.getMessage() and r.exc_info for r in caplog.records)
