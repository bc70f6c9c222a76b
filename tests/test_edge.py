"""One edge for requests (DESIGN 8.17): the CLI, the service (what the Triton models run) and the config constructors
refuse the same bad values with the same message, the field spelled as each front end spells it; a bad request
sent to a running service is refused alone while the valid ones in flight finish with their plain text. A tiny
seeded random model with the default model's real tokenizer: no server, no default weights."""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from spork_trt.cli import main as cli
from spork_trt.config import GenerateConfig, SamplingConfig, SpecConfig
from spork_trt.loop.engine_core import CoreConfig
from spork_trt.errors import FieldError, UserError
from spork_trt.io_spec import FIELDS
from spork_trt.serving.engine_service import Chunk, Service
from spork_trt.serving.triton_steps import decode_chunk
from tests.conftest import tiny_config

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]
# (config field, value, the message after the field's name); the CLI gets the value as typed, the service as the
# tensor Triton would hand it (FP32, INT32, UINT64)
BAD = [
    ("temperature", 1e-38, "must be >= 0.01 and finite, or 0 for greedy, got 1e-38"),  # overflowed to NaN before
    ("temperature", -1.0, "must be >= 0.01 and finite, or 0 for greedy, got -1.0"),
    ("temperature", math.nan, "must be >= 0.01 and finite, or 0 for greedy, got nan"),
    ("temperature", math.inf, "must be >= 0.01 and finite, or 0 for greedy, got inf"),
    ("top_p", 0.0, "must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "must be in (0, 1], got 1.5"),
    ("top_k", -1, "must be >= 0 (0 disables it), got -1"),
    ("max_new_tokens", 0, "must be a positive number of tokens, got 0"),
    ("seed", 2**64 - 1, "must be in [0, 2**64 - 1), got 18446744073709551615"),
]
TENSOR_DTYPES = {"temperature": np.float32, "top_p": np.float32, "top_k": np.int32, "max_new_tokens": np.int32,
                 "seed": np.uint64}


def one(value, dtype):
    return np.array([[value]], dtype=dtype)  # [1, 1]: a batch of one


@pytest.fixture(scope="module")
def runtime():
    from spork_trt.engines.torch_engine import TorchEngine
    from spork_trt.loop.runtime import Runtime
    from spork_trt.checkpoint.tokenizer import load_tokenizer
    from spork_trt.checkpoint.weights import default_gguf_path, random_checkpoint

    model = random_checkpoint(tiny_config(), seed=5, scale=8.0).model
    return Runtime(model.cfg, load_tokenizer(default_gguf_path(), "gguf"), TorchEngine(model),
                   lambda kind, arg: None)


@pytest.fixture(scope="module")
def service(runtime):
    s = Service(runtime, SpecConfig.for_draft("ngram"), CoreConfig(slots=4, max_len=128))
    yield s
    s.close()


def config_error(field: str, value) -> FieldError:
    with pytest.raises(FieldError) as e:
        if field in ("max_new_tokens",):
            GenerateConfig(**{field: value})
        else:
            SamplingConfig(**{field: value})
    return e.value


@pytest.mark.parametrize("field,value,rest", BAD)
def test_every_front_end_refuses_a_bad_value_with_the_same_message(field, value, rest, service, capsys):
    f = FIELDS[field]
    assert str(config_error(field, value)) == f"{field} {rest}"

    assert cli.main(["generate", "hi", f.flag, str(value)]) == 2  # refused before any model loads
    assert capsys.readouterr().err == f"error: {f.flag} {rest}\n"

    with pytest.raises(UserError) as e:  # what the Triton `spork` model calls, refused before it is queued
        service.submit({"input_ids": np.array([PROMPT], np.int32), f.tensor.name: one(value, TENSOR_DTYPES[field])},
                       send=lambda c: None, fail=lambda e: None)
    assert str(e.value) == f"{f.tensor.name} {rest}"
    assert service.active == 0


@pytest.mark.parametrize("ids,rest", [([5, 96, 7], "got 96 at position 1"), ([-1, 5], "got -1 at position 0"),
                                      ([5, 2**31 - 1], "got 2147483647 at position 1")])
def test_prompt_ids_outside_the_vocabulary_are_refused_at_the_edge(ids, rest, service):
    with pytest.raises(UserError, match=rf"^input_ids must be token ids in \[0, 96\), {rest}$"):
        service.submit({"input_ids": np.array([ids], np.int32)}, send=lambda c: None, fail=lambda e: None)
    assert service.active == 0


def test_the_service_names_the_tensors_for_lengths(service):
    ids = {"input_ids": np.array([PROMPT], np.int32)}
    with pytest.raises(UserError, match="^max_tokens 200 is beyond the context: the prompt has 8 tokens and the "
                                        "context window is 109, so at most 101 new tokens fit$"):
        service.submit(ids | {"max_tokens": one(200, np.int32)}, send=lambda c: None, fail=lambda e: None)
    with pytest.raises(UserError, match="^text_input encodes to no tokens: send some text$"):
        service.submit({"input_ids": np.zeros((1, 0), np.int32)}, send=lambda c: None, fail=lambda e: None)


def submit(service, inputs) -> dict:
    """Submit without waiting; the returned dict gets the chunks, and `error` or `done` set."""
    out: dict = {"chunks": [], "done": threading.Event()}

    def send(c: Chunk) -> None:
        out["chunks"].append(c)
        if c.final:
            out["done"].set()

    def fail(e: BaseException) -> None:
        out["error"] = e
        out["done"].set()

    service.submit(inputs, send, fail)
    return out


def text(tok, chunks: list[Chunk]) -> str:
    return "".join(decode_chunk(tok, np.array([c.output_ids], np.int32), one(c.sent_len, np.int32),
                                one(c.final, np.bool_))[0, 0].decode() for c in chunks)


def test_a_bad_request_fails_alone_while_the_valid_ones_finish_with_their_plain_text(service, runtime):
    """Before the edge: a temperature of 1e-38 overflowed in the step's sampling and ids past the vocabulary failed
    the step's forward, and a failing step answers every request in flight with its error."""
    plain = runtime.generate(PROMPT, GenerateConfig(max_new_tokens=40), mode="plain")
    valid = {"input_ids": np.array([PROMPT], np.int32), "max_tokens": one(40, np.int32),
             "stream": one(True, np.bool_)}
    bad = [{**valid, "temperature": one(1e-38, np.float32)}, {**valid, "temperature": one(np.nan, np.float32)},
           {**valid, "input_ids": np.array([PROMPT + [10**6]], np.int32)}]
    first = submit(service, valid)  # in flight while the bad ones arrive
    refused = []
    for inputs in bad:
        try:
            refused.append(submit(service, inputs))  # the old edge let them in: they fail in the core instead
        except UserError as e:
            refused.append({"error": e})
    second = submit(service, valid)  # joins after them
    for r in (first, second, *refused):
        assert "done" not in r or r["done"].wait(120)
    assert [type(r.get("error")) for r in refused] == [FieldError, FieldError, UserError]
    assert [str(r["error"]).split()[0] for r in refused] == ["temperature", "temperature", "input_ids"]
    for r in (first, second):
        assert "error" not in r, r["error"]
        assert [t for c in r["chunks"] for t in c.output_ids[c.sent_len:]] == plain.token_ids
        assert text(runtime.tokenizer, r["chunks"]) == plain.text
    assert service.active == 0


def test_an_empty_stop_string_is_refused_not_a_stop_after_one_token(capsys):
    with pytest.raises(FieldError, match="^stop_strings must be non-empty text, got ''$"):
        GenerateConfig(stop_strings=("\n", ""))
    assert cli.main(["generate", "hi", "--stop", ""]) == 2
    assert capsys.readouterr().err == "error: --stop must be non-empty text, got ''\n"
