"""The serving logic without Triton: request validation names the field, streamed chunks reassemble the exact
text, per-request state is independent, cancellation stops at the next step."""
from __future__ import annotations

import random
import re
import threading

import numpy as np
import pytest

from spork_trt import io_spec
from spork_trt.config import GenerateConfig
from spork_trt.errors import UserError
from spork_trt.serving.request_tensors import Limits, parse_request
from spork_trt.serving.engine_service import DETOKENIZE_CONTEXT, Chunk, Service
from spork_trt.serving.triton_steps import decode_chunk, encode_text
from spork_trt.checkpoint.tokenizer import text_delta

CONTEXT = 64
LIMITS = Limits(CONTEXT, vocab_size=96)
IDS = np.array([[5, 6, 7, 8]], np.int32)  # [1, n]


def one(value, dtype):
    return np.array([[value]], dtype=dtype)  # [1, 1]: a batch of one


@pytest.mark.parametrize("field,value,needle", [
    ("max_tokens", one(0, np.int32), "max_tokens must be a positive"),
    ("max_tokens", one(-3, np.int32), "max_tokens must be a positive"),
    ("max_tokens", one(61, np.int32), "max_tokens 61 is beyond the context"),
    ("temperature", one(-0.1, np.float32), "temperature must be >= 0"),
    ("temperature", one(np.nan, np.float32), "temperature must be >= 0"),
    ("top_p", one(0.0, np.float32), "top_p must be in (0, 1]"),
    ("top_k", one(-1, np.int32), "top_k must be >= 0"),
    ("spec_mode", one(b"gate", np.object_), "unknown spec_mode 'gate'"),
    ("max_tokens", np.array([[1, 2]], np.int32), "max_tokens must hold one value"),
    ("timeout_s", one(0.0, np.float32), "timeout_s must be in (0, 600]"),
    ("timeout_s", one(np.nan, np.float32), "timeout_s must be in (0, 600]"),
    ("timeout_s", one(601.0, np.float32), "timeout_s must be in (0, 600] seconds (this server's longest)"),
    ("logprobs", one(21, np.int32), "logprobs must be 0 to 20"),
    ("logprobs", one(-1, np.int32), "logprobs must be 0 to 20"),
])
def test_bad_request_names_the_field(field, value, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_request({"input_ids": IDS, field: value}, LIMITS)


def words(*items) -> np.ndarray:
    return np.array([[w if isinstance(w, bytes) else w.encode() for w in items]], np.object_)  # [1, n]


@pytest.mark.parametrize("field,value,needle", [
    ("stop_words", words("ok", ""), "stop_words must be non-empty text, got ''"),
    ("stop_words", words(*"abcdefghijklmnopq"), "stop_words holds 17 strings: at most 16"),
    ("stop_words", words("x" * 65), "stop_words must be at most 64 characters each, got one of 65"),
    ("stop_words", words(b"\xff"), "stop_words must be UTF-8 text"),
    ("frequency_penalty", one(0.5, np.float32), "frequency_penalty=0.5 is not supported by this server (only "
                                                "frequency_penalty=0.0"),
    ("presence_penalty", one(-1.0, np.float32), "presence_penalty=-1.0 is not supported"),
    ("exclude_input_in_output", one(False, np.bool_), "exclude_input_in_output=False is not supported"),
    ("random_seed", one(2**64 - 1, np.uint64), "random_seed must be in [0, 2**64 - 1)"),  # named as it was sent
])
def test_bad_stop_words_and_tensorrt_llm_inputs_name_the_field(field, value, needle):
    with pytest.raises(UserError, match=re.escape(needle)):
        parse_request({"input_ids": IDS, field: value}, LIMITS)


def test_stop_words_and_the_inputs_tensorrt_llm_clients_send():
    """What Triton's OpenAI frontend sends a TensorRT-LLM-style model: honoured, accepted at the one value this server
    works at, or accepted and ignored (io_spec.COMPAT_INPUTS)."""
    req = parse_request({"input_ids": IDS, "stop_words": words("\n\n", "User:"), "random_seed": one(7, np.uint64),
                         "frequency_penalty": one(0.0, np.float32), "presence_penalty": one(0.0, np.float32),
                         "exclude_input_in_output": one(True, np.bool_),
                         "return_num_input_tokens": one(True, np.bool_),
                         "return_num_output_tokens": one(False, np.bool_)}, LIMITS)
    assert req.cfg.stop_strings == ("\n\n", "User:") and req.cfg.sampling.seed == 7
    assert parse_request({"input_ids": IDS, "seed": one(3, np.uint64)}, LIMITS).cfg.sampling.seed == 3
    assert parse_request({"input_ids": IDS, "stop_words": words()}, LIMITS).cfg.stop_strings == ()  # [1, 0]: none
    with pytest.raises(UserError, match="random_seed and seed name the same setting: send one of them"):
        parse_request({"input_ids": IDS, "seed": one(1, np.uint64), "random_seed": one(1, np.uint64)}, LIMITS)
    spork = next(s for s in io_spec.TRITON_STEPS if s.name == "spork")
    sent = {"text_input", "stream", "max_tokens", "stop_words", "top_p", "frequency_penalty", "presence_penalty",
            "seed", "random_seed", "temperature", "exclude_input_in_output", "return_num_input_tokens",
            "return_num_output_tokens"}  # python/openai/openai_frontend/engine/utils/triton.py, 2.52 to 2.71
    assert sent <= {t.name for t in io_spec.ENSEMBLE_INPUTS} and sent - {"text_input"} <= {t.name for t in spork.inputs}
    assert {"text_output", "num_input_tokens", "num_output_tokens"} <= {t.name for t in io_spec.ENSEMBLE_OUTPUTS}


class Pieces:
    """A tokenizer whose token i is the text pieces[i] (Tokenizer.decode calls hf.decode)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)

    def __len__(self) -> int:
        return len(self.pieces)


def test_postprocessing_ends_the_final_text_where_the_first_stop_string_starts():
    from spork_trt.checkpoint.tokenizer import Tokenizer

    tok = Tokenizer(Pieces(["The", " cat", " sat", ".", " END", " more"]), frozenset())
    ids = np.array([[0, 1, 2, 3, 4, 5]], np.int32)

    def text(sent, final, cut_at):
        return decode_chunk(tok, ids, one(sent, np.int32), one(final, np.bool_), cut_at)[0, 0].decode()

    assert text(2, True, words("END", ". E")) == " sat"  # the earliest start among them
    assert text(2, True, words()) == text(2, True, None) == " sat. END more"


@pytest.mark.parametrize("ids,sent,cuts,needle", [
    ([1] * (2**16 + 1), 0, None, "output_ids must be at most 65536"),
    ([5, 49152], 0, None, "output_ids must be at most 65536 token ids in [0, 49152)"),
    ([5, -1], 0, None, "in [0, 49152)"),
    ([5, 6], 3, None, "sent_len must be in [0, 2]"),
    ([5, 6], 0, [b"x"] * 65, "cut_at must hold at most 64"),
    ([5, 6], 0, [b"\xff"], "cut_at must be UTF-8"),
])
def test_postprocessing_called_directly_refuses_what_spork_never_sends(default_tokenizer, ids, sent, cuts, needle):
    """Postprocessing is a model a client can call: ids past the vocabulary or a bound, a sent_len outside them,
    too many or non-UTF-8 stop strings are one clear error (INVALID_ARG), not a traceback or unbounded work."""
    cut_at = None if cuts is None else np.array([cuts], np.object_)
    with pytest.raises(UserError, match=re.escape(needle)):
        decode_chunk(default_tokenizer, np.array([ids], np.int32), one(sent, np.int32), one(True, np.bool_), cut_at)


def test_a_chunk_carries_the_counts_and_the_final_one_the_stop_strings():
    from spork_trt.loop.stats import Stats

    c = Chunk([1, 2, 3, 4, 5], 2, True, Stats(), "stop_string", prompt_len=9, cut_at=("a", "bc"))
    t = c.tensors()
    assert t["num_input_tokens"].tolist() == [[9]] and t["num_output_tokens"].tolist() == [[3]]  # 3 new ones
    assert t["cut_at"].tolist() == [[b"a", b"bc"]] and t["stop_reason"].tolist() == [[b"stop_string"]]
    assert Chunk([1], 0, False, Stats(), "", 9).tensors()["cut_at"].shape == (1, 0)
    empty = Chunk([1], 0, False, Stats(), "", 9).tensors()  # no logprobs asked for: empty, every shape kept
    assert [empty[k].shape for k in ("output_logprobs", "top_logprob_ids", "top_logprobs")] == [(1, 0), (1, 0, 0),
                                                                                              (1, 0, 0)]


def test_a_chunk_carries_the_logprobs_of_its_new_tokens():
    from spork_trt.loop.stats import Stats
    from spork_trt.spec.logprobs import TokenLogprob

    logs = (TokenLogprob(4, -0.5, ((4, -0.5), (9, -1.5))), TokenLogprob(5, -2.0, ((7, -0.25), (5, -2.0))))
    t = Chunk([3, 4, 5], 1, False, Stats(), "", 9, logprobs=logs, top=2).tensors()
    assert t["output_logprobs"].tolist() == [[-0.5, -2.0]]
    assert t["top_logprob_ids"].tolist() == [[[4, 9], [7, 5]]] and t["top_logprobs"].tolist() == [[[-0.5, -1.5],
                                                                                                  [-0.25, -2.0]]]


def test_clients_build_their_tensors_from_the_steps_tables_and_the_service_reads_them_back():
    """The `client` command's ensemble tensors and the OpenAI API's spork tensors come from io_spec's tables (dtype,
    [1, 1] or [1, n]); what the OpenAI API sends is what the spork step parses back."""
    from spork_trt.config import SamplingConfig
    from spork_trt.serving.openai_api.params import Job
    from spork_trt.serving.openai_api.upstream import SPORK_STEP, inputs
    from spork_trt.serving.triton_client import ClientConfig, request_values

    sent = request_values("héllo", ClientConfig(stop_words=("a", "b"), seed=3, deadline_s=5.0, spec_mode="plain"))
    table = {t.name: t for t in io_spec.ENSEMBLE_INPUTS}
    for name, (arr, dtype) in sent.items():
        t = table[name]
        assert dtype == ("BYTES" if t.dtype == "STRING" else t.dtype) and arr.dtype == io_spec.NUMPY[t.dtype]
        assert arr.shape == ((1, 2) if name == "stop_words" else (1, 1)), name
    assert sent["text_input"][0][0, 0].decode() == "héllo" and "top_p" not in sent  # None: not sent
    job = Job("chat.completion", (5, 6, 7), GenerateConfig(10, SamplingConfig(temperature=0.5, seed=9), ("x",)),
              True, False, logprobs=2, cache_scope="ab")
    tensors = {t.name(): (t.shape(), t.datatype()) for t in inputs(job)}
    assert tensors["input_ids"] == ([1, 3], "INT32") and tensors["seed"] == ([1, 1], "UINT64")
    assert set(tensors) <= {t.name for t in SPORK_STEP.inputs}
    arrays = io_spec.request_arrays(SPORK_STEP, {"input_ids": job.prompt_ids, "max_tokens": 10, "temperature": 0.5,
                                                 "seed": 9, "stop_words": ("x",), "logprobs": 2})
    req = parse_request({k: a for k, (a, _) in arrays.items()}, LIMITS)
    assert req.prompt_ids == [5, 6, 7] and req.cfg.max_new_tokens == 10 and req.cfg.sampling.seed == 9
    assert req.cfg.stop_strings == ("x",) and req.logprobs == 2


def test_defaults_and_limits():
    req = parse_request({"input_ids": IDS}, LIMITS)
    assert req.mode == "spork" and not req.stream and req.cfg.sampling.greedy and req.prompt_ids == [5, 6, 7, 8]
    assert req.cfg.max_new_tokens == CONTEXT - 4  # the default, clipped to the context
    assert parse_request({"input_ids": IDS, "max_tokens": one(60, np.int32)}, LIMITS).cfg.max_new_tokens == 60
    with pytest.raises(UserError, match="text_input has 4 tokens but the context window is 4"):
        parse_request({"input_ids": IDS}, Limits(4, 96))
    with pytest.raises(UserError, match="stream=true needs the streaming model"):
        parse_request({"input_ids": IDS, "stream": one(True, np.bool_)}, LIMITS, can_stream=False)
    assert req.cache_scope == "" and parse_request({"input_ids": IDS, "cache_scope": words("t1")}, LIMITS).cache_scope == "t1"
    with pytest.raises(UserError, match="cache_scope must be at most 128 characters"):
        parse_request({"input_ids": IDS, "cache_scope": words("x" * 129)}, LIMITS)


@pytest.mark.slow
def test_preprocessing_refuses_empty_and_invalid_utf8(default_tokenizer):
    with pytest.raises(UserError, match="not valid UTF-8"):
        encode_text(default_tokenizer, one(b"ok \xff\xfe", np.object_))
    with pytest.raises(UserError, match="text_input is empty"):
        encode_text(default_tokenizer, one(b"  \n", np.object_))
    with pytest.raises(UserError, match='text_input is missing: send the prompt as "text_input"'):
        encode_text(default_tokenizer, None)
    ids = encode_text(default_tokenizer, one("héllo".encode(), np.object_))
    assert ids.dtype == np.int32 and ids.shape[0] == 1
    assert ids[0].tolist() == default_tokenizer.encode_prompt("héllo")


@pytest.mark.slow
def test_preprocessing_does_not_template_a_conversation_twice(default_tokenizer):
    """Triton's own OpenAI frontend renders the conversation with the model's chat template and sends it as
    text_input: it reaches the model as rendered, exactly the ids the template gives, not wrapped again."""
    tok = default_tokenizer
    turns = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"},
             {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "How are you?"}]
    rendered = tok.hf.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert tok.template_opening == "<|im_start|>" and tok.is_rendered(rendered)
    ids = encode_text(tok, one(rendered.encode(), np.object_))[0].tolist()
    assert ids == tok.hf.encode(rendered, add_special_tokens=False) and ids.count(1) == 5  # 4 turns and the answer's opening
    one_turn = tok.hf.apply_chat_template(turns[1:2], tokenize=False, add_generation_prompt=True)
    assert encode_text(tok, one(one_turn.encode(), np.object_))[0].tolist() == tok.encode_prompt("Hello")
    plain = encode_text(tok, one(b"Hello <|im_start|>", np.object_))[0].tolist()  # not at the start: a message
    assert plain == tok.encode_prompt("Hello <|im_start|>") and not tok.is_rendered("Hello <|im_start|>")


@pytest.mark.slow
def test_preprocessing_refuses_a_text_too_long_for_the_context_before_any_work(default_tokenizer):
    limit = default_tokenizer.max_text_bytes(64)
    big = one(b"\xff" * (limit + 1), np.object_)  # not UTF-8: decoding it first would say so
    with pytest.raises(UserError, match=f"text_input is {limit + 1} bytes: no text over {limit} bytes fits"):
        encode_text(default_tokenizer, big, limit)
    for text in ("word " * 500, "x" * 3000, "a" + " " * 3000, "def f():\n    return 1\n" * 100):  # never refuses what fits
        n = len(default_tokenizer.encode_prompt(text, raw=True))
        assert len(text.encode()) <= default_tokenizer.max_text_bytes(n)


@pytest.mark.slow
def test_stateless_deltas_never_split_characters(default_tokenizer):
    text = "naïve café → 東京 🙂🙂 done"
    ids = default_tokenizer.hf.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(20):  # random response boundaries, as the spork step's steps commit 1..k tokens
        cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(1, len(ids) - 1))) + [len(ids)]
        sent, deltas = 0, []
        for cut in cuts:
            out = decode_chunk(default_tokenizer, np.array([ids[:cut]], np.int32), one(sent, np.int32),
                               one(cut == len(ids), np.bool_))
            deltas.append(out[0, 0].decode("utf-8"))  # valid UTF-8 in every response
            sent = cut
        assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
    emoji = default_tokenizer.hf.encode("🙂", add_special_tokens=False)
    assert len(emoji) > 1  # a multi-token character: held back until complete, flushed when final
    assert text_delta(default_tokenizer, emoji[:1], 0, final=False) == ""
    assert text_delta(default_tokenizer, emoji[:1], 0, final=True) == "\ufffd"


@pytest.fixture(scope="module")
def service(default_runtime):
    from spork_trt.config import SpecConfig

    s = Service(default_runtime, SpecConfig.for_draft("ngram"))
    yield s
    s.close()


def run(service, prompt_ids, max_tokens, stream, cancel_after=None, **more):
    chunks: list[Chunk] = []
    inputs = {"input_ids": np.array([prompt_ids], np.int32), "max_tokens": one(max_tokens, np.int32),
              "stream": one(stream, np.bool_), **more}
    done = service.run(inputs, chunks.append,
                       cancelled=lambda: cancel_after is not None and len(chunks) >= cancel_after)
    return done, chunks


def tokens(chunks: list[Chunk]) -> list[int]:
    """Every token of a stream: each response's ids after those earlier responses carried."""
    return [t for c in chunks for t in c.output_ids[c.sent_len:]]


@pytest.mark.slow
def test_stream_and_single_response_match_plain_greedy(service, default_runtime, default_tokenizer):
    from spork_trt.config import GenerateConfig

    prompt = default_tokenizer.encode_prompt("Name three planets.")
    plain = default_runtime.generate(prompt, GenerateConfig(max_new_tokens=24), mode="plain")
    done, single = run(service, prompt, 24, stream=False)
    assert done and len(single) == 1 and single[0].final and single[0].output_ids == plain.token_ids
    done, chunks = run(service, prompt, 24, stream=True)
    assert done and chunks[-1].final and not any(c.final for c in chunks[:-1])
    assert tokens(chunks) == plain.token_ids  # each token sent once
    assert all(c.sent_len <= DETOKENIZE_CONTEXT for c in chunks)  # a window, never the whole prefix
    assert chunks[-1].stop_reason == plain.stop_reason
    text = "".join(decode_chunk(default_tokenizer, np.array([c.output_ids], np.int32), one(c.sent_len, np.int32),
                                one(c.final, np.bool_))[0, 0].decode() for c in chunks)
    assert text == plain.text
    st, stats = chunks[-1].tensors(), chunks[-1].stats
    assert st["num_steps"][0, 0] == stats.steps >= 1 and st["total_draft_tokens"][0, 0] == stats.draft_tokens
    assert st["total_accepted_draft_tokens"][0, 0] == stats.accepted_tokens <= stats.draft_tokens


def texts(tok, chunks: list[Chunk]) -> list[str]:
    """What postprocessing makes of each response."""
    return [decode_chunk(tok, np.array([c.output_ids], np.int32), one(c.sent_len, np.int32), one(c.final, np.bool_),
                         words(*c.cut_at))[0, 0].decode() for c in chunks]


@pytest.mark.slow
def test_stop_words_end_the_request_in_the_core_and_the_text_where_they_start(service, default_runtime,
                                                                              default_tokenizer):
    from spork_trt.config import GenerateConfig
    from spork_trt.serving.openai_api.stops import tokens_through_stop

    prompt = default_tokenizer.encode_prompt("Name three planets.")
    plain = default_runtime.generate(prompt, GenerateConfig(max_new_tokens=32), mode="plain")
    for at in (len(plain.text) // 3, len(plain.text) // 2):
        stop = plain.text[at:at + 5]  # inside the answer, likely across tokens
        cut = plain.text[:plain.text.index(stop)]
        through = tokens_through_stop(plain.token_ids, default_tokenizer.decode, (stop,))
        for stream in (False, True):
            done, chunks = run(service, prompt, 32, stream, stop_words=words(stop, "\u2603never"))
            assert done and chunks[-1].stop_reason == "stop_string" and tokens(chunks) == plain.token_ids[:through]
            # the responses add up to the text before the stop string: none sent a part of it (nothing takes it back)
            assert "".join(texts(default_tokenizer, chunks)) == cut and all(c.cut_at == () for c in chunks[:-1])
            assert sum(int(c.tensors()["num_output_tokens"][0, 0]) for c in chunks) == through


@pytest.mark.slow
def test_concurrent_requests_have_independent_state(service, default_tokenizer):
    prompts = [default_tokenizer.encode_prompt(p) for p in ("Count to five.", "Name a color.", "Say hi in Spanish.")]
    alone = [run(service, p, 16, stream=False)[1][-1].output_ids for p in prompts]
    got: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda k=k: got.__setitem__(k, tokens(run(service, prompts[k], 16, True)[1])))
               for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[k] for k in range(len(prompts))] == alone
    assert service.active == 0


@pytest.mark.slow
def test_a_request_past_its_deadline_ends_with_what_it_generated(service, default_runtime, default_tokenizer):
    """timeout_s: the request leaves the core at the first step after its deadline (its slot freed) and is answered
    with the tokens so far, stop_reason "timeout": a prefix of plain greedy decoding; the default is the server's."""
    assert parse_request({"input_ids": IDS}, LIMITS).timeout_s == LIMITS.timeout_s
    prompt = default_tokenizer.encode_prompt("Write a long story about a dragon.")
    for stream in (True, False):
        done, chunks = run(service, prompt, 400, stream, timeout_s=one(0.5, np.float32))
        got = tokens(chunks)
        assert done and chunks[-1].final and chunks[-1].stop_reason == "timeout" and 0 < len(got) < 400
        assert got == default_runtime.generate(prompt, GenerateConfig(max_new_tokens=len(got))).token_ids
        assert service.active == 0


@pytest.mark.slow
def test_cancelled_request_stops_and_sends_nothing_more(service, default_tokenizer):
    prompt = default_tokenizer.encode_prompt("Write a long story about a dragon.")
    done, chunks = run(service, prompt, 200, stream=True, cancel_after=2)
    assert not done and len(chunks) == 2 and not chunks[-1].final and service.active == 0


@pytest.mark.slow  # the session's default build (about a minute)
@pytest.mark.parametrize("draft", ["eagle", "store-eagle"])
def test_loading_refuses_a_drafter_the_build_lacks_in_one_line(default_engines, draft):
    """The server's model fails at load, not on its first request: a default build has a datastore, no head."""
    with pytest.raises(UserError, match="needs a build with a draft head"):
        Service.load(default_engines, draft)


@pytest.mark.slow
def test_a_service_on_the_device_engine_drafts_from_the_build_losslessly(default_engines, default_runtime,
                                                                          default_tokenizer):
    """Service.load with a device (the Triton gpu profile's target; cpu runs the device engine's code eagerly): the
    build's datastore drafts for it, its answer is the reference engine's plain greedy one, and what it cannot run
    (drafts on the target's cache) is refused at load."""
    from spork_trt.config import GenerateConfig
    from spork_trt.loop.engine_core import CoreConfig

    svc = Service.load(default_engines, core=CoreConfig(slots=2), device="cpu", dtype="fp32")
    try:
        assert svc.runtime.backend == "torch-cpu-fp32" and svc.spec.draft == "store"
        prompt = default_tokenizer.encode_prompt("List three uses of a paperclip.")
        done, chunks = run(svc, prompt, 32, stream=True)
        assert done and tokens(chunks) == default_runtime.generate(prompt, GenerateConfig(max_new_tokens=32),
                                                                   mode="plain").token_ids
        assert chunks[-1].stats.draft_tokens > 0
    finally:
        svc.close()
    with pytest.raises(UserError, match="not with the device engine"):
        Service.load(default_engines, "early-exit:8", device="cpu")


def test_the_device_engine_needs_the_builds_own_checkpoint(tmp_path):
    from spork_trt.loop.runtime import source_checkpoint

    with pytest.raises(UserError, match="which is not here"):
        source_checkpoint({"source": {"path": str(tmp_path / "gone.gguf"), "sha256": "0" * 64}})
    changed = tmp_path / "model.gguf"
    changed.write_bytes(b"not the same bytes")
    with pytest.raises(UserError, match="changed since the build"):
        source_checkpoint({"source": {"path": str(changed), "sha256": "0" * 64}})
