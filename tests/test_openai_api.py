"""The OpenAI-compatible front end: `python -m spork_trt serve --openai-port` in front of a real tritonserver, asked
with the real `openai` client. Greedy answers equal local plain greedy generation (chat through the template, raw
completions), streamed == not streamed, usage exact, stop strings never leak, bad requests answered in OpenAI's
error shape naming the field while the server keeps serving, a client that leaves cancels its request. The stop
filter itself is checked without a server."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from spork_trt.serving.openai_api.stops import StopFilter, tokens_through_stop
from spork_trt.serving.triton_server import free_port
from tests.conftest import mt_bench_prompts

slow = pytest.mark.slow
MAX_TOKENS = 48


def test_stop_filter_holds_back_only_what_could_start_a_stop():
    f = StopFilter(("###", "END"))
    assert f.feed("hello #") == "hello "  # "#" could begin "###"
    assert f.feed("# x") == "## x"  # it did not
    assert f.feed(" E") == " "
    assert f.feed("NDING") == "" and f.stopped  # "END" starts at the held "E": nothing after it goes
    assert f.feed("more") == "" and f.flush() == ""
    g = StopFilter(("\n\n",))
    assert g.feed("a\n") == "a" and g.flush() == "\n"  # the stream ended: the held text was never a stop
    h = StopFilter(("cat",))
    assert "".join(h.feed(c) for c in "the black cat sat") == "the black " and h.stopped


def test_an_upstream_refusal_is_a_400_a_full_queue_a_503_and_a_failure_a_500_without_its_text():
    from spork_trt.serving.openai_api.upstream import upstream_error

    bad = upstream_error("top_k must be in [-2147483648, 2147483648) (a INT32 tensor), got 4294967297")
    assert (bad.status, bad.code) == (400, "invalid_value") and bad.message.startswith("top_k must be")
    busy = upstream_error("all 8 slots are in use and 64 requests wait for one (max_queue): retry later")
    assert busy.status == 503
    failed = upstream_error("Traceback ... KeyError: 'secret internal detail'")
    assert failed.status == 500 and "secret" not in failed.message


def test_tokens_through_stop_is_the_first_prefix_holding_it():
    pieces = ["ab", "c#", "#d", "e"]

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    assert tokens_through_stop([0, 1, 2, 3], decode, ("##",)) == 3
    assert tokens_through_stop([0, 1, 2, 3], decode, ("zz",)) == 4


@pytest.fixture(scope="module")
def api(default_engines, tmp_path_factory):
    """`serve` with the OpenAI API on free ports; yields (base_url, model name, serve process)."""
    proc, base, name = start_serve(["--engines", str(default_engines), "--chat-template", "generic"],
                                   tmp_path_factory.mktemp("openai"))
    try:
        yield base, name, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def start_serve(args: list[str], where) -> tuple[subprocess.Popen, str, str]:
    """`python -m spork_trt serve ARGS` on free ports, ready: (its process, the API's base URL, the model's name)."""
    ports = [free_port() for _ in range(4)]
    err = where / "serve.err"  # a file, not a pipe nobody reads
    proc = subprocess.Popen([sys.executable, "-m", "spork_trt", "serve", *args, "--http-port", str(ports[0]),
                             "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), "--openai-port",
                             str(ports[3])], stderr=err.open("w"), text=True)
    proc.err, proc.grpc_url, base = err, f"127.0.0.1:{ports[1]}", f"http://127.0.0.1:{ports[3]}"
    deadline = time.monotonic() + 300
    while "ready:" not in err.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(err.read_text())
        time.sleep(0.2)
    with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
        return proc, base, json.loads(r.read())["data"][0]["id"]


@pytest.fixture(scope="module")
def client(api):
    import openai

    return openai.OpenAI(base_url=api[0] + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(default_engines):
    """Plain greedy decoding on the same engines, in this process: (text, token ids) of prompt ids."""
    from spork_trt.config import GenerateConfig
    from spork_trt.config import AUTO_DTYPE
    from spork_trt.loop.runtime import Runtime

    rt = Runtime.from_engines(default_engines, dtype=AUTO_DTYPE)

    def run(ids: list[int], max_tokens: int = MAX_TOKENS, grammar=None):
        r = rt.generate(ids, GenerateConfig(max_new_tokens=max_tokens), grammar=grammar)
        return r.text, r.token_ids

    run.tok, run.rt = rt.tokenizer, rt
    return run


def streamed(client, kind: str, **kw):
    """(text, finish_reason, usage, final metrics) of a streamed answer."""
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    text, finish, usage, metrics = [], None, None, None
    for c in create(stream=True, stream_options={"include_usage": True}, **kw):
        if c.choices:
            ch = c.choices[0]
            piece = ch.delta.content if kind == "chat" else ch.text
            text.append(piece or "")
            finish = ch.finish_reason or finish
        if c.usage:
            usage, metrics = c.usage, c.model_extra["metrics"]
    return "".join(text), finish, usage, metrics


def finish_of(ids) -> str:
    return "length" if len(ids) == MAX_TOKENS else "stop"


@slow
def test_chat_equals_local_greedy_streamed_or_not(api, client, reference):
    _, model, _ = api
    for prompt in mt_bench_prompts(3):
        ids = reference.tok.encode_prompt(prompt)
        want, want_ids = reference(ids)
        kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0)
        r = client.chat.completions.create(**kw)
        assert r.choices[0].message.content == want, prompt[:40]
        assert r.choices[0].finish_reason == finish_of(want_ids) and r.object == "chat.completion"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want_ids))
        assert 0 <= r.usage.prompt_tokens_details.cached_tokens < len(ids)
        spec = r.model_extra["metrics"]["speculative_decoding"]
        assert spec["mean_accepted_length"] >= 1 and 0 <= spec["acceptance_rate"] <= 1 and spec["draft_tokens"] >= 0
        text, finish, usage, metrics = streamed(client, "chat", **kw)
        assert text == want and finish == r.choices[0].finish_reason
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(want_ids))
        assert metrics["speculative_decoding"]["steps"] >= 1
        # the same prompt again: it reuses the rows the first answer left (all but its last token), same text
        assert usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    plain = client.chat.completions.create(**kw, extra_body={"spec_mode": "plain"})  # the baseline: same text
    assert plain.choices[0].message.content == want
    assert plain.model_extra["metrics"]["speculative_decoding"]["draft_tokens"] == 0


@slow
def test_conversation_and_raw_completion_reach_the_model_as_written(api, client, reference):
    _, model, _ = api
    convo = [{"role": "system", "content": "You are a terse assistant."},
             {"role": "user", "content": "Name a prime number."}, {"role": "assistant", "content": "7."},
             {"role": "user", "content": "And a larger one?"}]
    hf = reference.tok.hf
    ids = hf.encode(hf.apply_chat_template(convo, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)
    want, want_ids = reference(ids)
    r = client.chat.completions.create(model=model, messages=convo, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(ids)
    prompt = "def fibonacci(n):\n"
    ids = reference.tok.encode_prompt(prompt, raw=True)
    want, want_ids = reference(ids)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == want and r.object == "text_completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want_ids))
    text, finish, usage, _ = streamed(client, "completion", model=model, prompt=prompt, max_tokens=MAX_TOKENS)
    assert text == want and finish == r.choices[0].finish_reason and usage.completion_tokens == len(want_ids)


@slow
def test_stop_strings_end_the_answer_where_they_start(api, client, reference):
    _, model, _ = api
    prompt = mt_bench_prompts(1)[0]
    ids = reference.tok.encode_prompt(prompt)
    want, want_ids = reference(ids)
    at = len(want) // 2
    stop = want[at:at + 6]  # a stop inside the answer, likely across two responses' text
    cut = want[:want.index(stop)]
    through = tokens_through_stop(want_ids, reference.tok.decode, (stop,))
    kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0)
    r = client.chat.completions.create(stop=[stop, "\u2603never"], **kw)
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == through
    text, finish, usage, _ = streamed(client, "chat", stop=stop, **kw)
    assert text == cut and finish == "stop" and usage.completion_tokens == through


def post(base: str, path: str, body) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


@slow
def test_bad_requests_get_openai_errors_naming_the_field(api, client):
    base, model, _ = api
    hi = [{"role": "user", "content": "hi"}]
    chat = {"model": model, "messages": hi}
    cases = [  # (path, body, status, param)
        ("/v1/chat/completions", {**chat, "model": "gpt-4o"}, 404, "model"),
        ("/v1/chat/completions", {"messages": hi}, 400, "model"),
        ("/v1/chat/completions", {**chat, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "tool", "content": "x"}]}, 400,
         "messages[0].tool_call_id"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content"),
        ("/v1/chat/completions", {**chat, "n": 17}, 400, "n"),
        ("/v1/chat/completions", {**chat, "n": 0}, 400, "n"),
        ("/v1/chat/completions", {**chat, "n": True}, 400, "n"),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "logprobs": 1}, 400, "logprobs"),
        ("/v1/completions", {"model": model, "prompt": "x", "logprobs": 6}, 400, "logprobs"),
        ("/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {"name": "f"}}],
                                  "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
        ("/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, 400,
         "tools[1].function.name"),
        ("/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {"name": "f"}}],
                                  "tool_choice": "required", "response_format": {"type": "json_object"}}, 400,
         "response_format"),
        ("/v1/chat/completions", {**chat, "logit_bias": {"42": 5}}, 400, "logit_bias"),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "xml"}}, 400, "response_format"),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "regex", "regex": "(unclosed"}}, 400,
         "response_format"),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": []}}, 400,
         "response_format"),
        ("/v1/chat/completions", {**chat, "temperature": -0.5}, 400, "temperature"),
        ("/v1/chat/completions", {**chat, "top_p": 1.5}, 400, "top_p"),
        ("/v1/chat/completions", {**chat, "top_k": -1}, 400, "top_k"),
        ("/v1/chat/completions", {**chat, "spec_mode": "gate"}, 400, "spec_mode"),
        ("/v1/chat/completions", {**chat, "seed": -3}, 400, "seed"),
        ("/v1/chat/completions", {**chat, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": 10**7}, 400, "max_completion_tokens"),
        ("/v1/chat/completions", {**chat, "stop": ["a", ""]}, 400, "stop"),
        ("/v1/chat/completions", {**chat, "stream": "yes"}, 400, "stream"),
        ("/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/chat/completions", {**chat, "frobnicate": 1}, 400, "frobnicate"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": ["user"], "content": "x"}]}, 400, "messages[0].role"),
        ("/v1/chat/completions", {**chat, "cache_salt": 5}, 400, "cache_salt"),
        ("/v1/chat/completions", {**chat, "cache_salt": "s" * 257}, 400, "cache_salt"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi " * 9000}]}, 400, "messages"),
        ("/v1/completions", {"model": model, "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"model": model, "prompt": "x", "echo": True}, 400, "echo"),
        ("/v1/completions", {"model": model, "prompt": "x", "messages": hi}, 400, "messages"),
    ]
    for path, body, status, param in cases:
        got, answer, _ = post(base, path, body)
        assert got == status, (param, answer)
        err = answer["error"]
        assert err["param"] == param and err["message"] and err["type"], answer
    got, answer, _ = post(base, "/v1/chat/completions", b"{not json")
    assert got == 400 and answer["error"]["message"] == "the request body is not valid JSON"
    import openai

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=hi)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=hi, n=17)  # past this server's cap
    assert e.value.body["param"] == "n"
    r = client.chat.completions.create(model=model, messages=hi, max_tokens=8)  # still serving
    assert r.choices[0].message.content and r.usage.completion_tokens <= 8


@slow
def test_models_health_and_a_client_that_leaves_cancels_its_request(api, client, default_engines):
    import openai

    base, model, _ = api
    assert [m.id for m in client.models.list().data] == [model]
    with urllib.request.urlopen(base + "/health", timeout=10) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    log = default_engines / "logs" / "tritonserver.log"
    before = log.read_text(errors="replace").count("request cancelled")
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=1.0).completions.create(model=model, prompt="Once upon a time", max_tokens=4000,
                                                            temperature=0.8, seed=1)
    deadline = time.monotonic() + 20
    while log.read_text(errors="replace").count("request cancelled") == before:
        assert time.monotonic() < deadline, "the gRPC stream to spork was not cancelled"
        time.sleep(0.2)


@slow
def test_a_second_turn_reuses_the_first_and_the_chat_cli_shows_it(api, client, reference):
    """A conversation's second turn (the first question, our answer, a new question) prefills only what is new:
    `cached_tokens` counts the reused prompt tokens and the answer equals local plain greedy decoding of the whole
    conversation. `spork_trt chat` runs the same two turns from a pipe."""
    base, model, _ = api
    first = [{"role": "user", "content": "Name three rivers in Europe."}]
    a1 = client.chat.completions.create(model=model, messages=first, max_tokens=MAX_TOKENS, temperature=0)
    convo = first + [{"role": "assistant", "content": a1.choices[0].message.content},
                     {"role": "user", "content": "Which of them is the longest?"}]
    a2 = client.chat.completions.create(model=model, messages=convo, max_tokens=MAX_TOKENS, temperature=0)
    hf = reference.tok.hf
    ids = hf.encode(hf.apply_chat_template(convo, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)
    assert a2.choices[0].message.content == reference(ids)[0]
    # at least the first turn's prompt; the answer as far as its text re-encodes to the ids generated (a generated
    # "\n\n" is one token, the template's encoding of it two)
    first_ids = hf.encode(hf.apply_chat_template(first, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    assert len(first_ids) <= a2.usage.prompt_tokens_details.cached_tokens < len(ids)
    chat = subprocess.run([sys.executable, "-m", "spork_trt", "chat", "--url", base + "/v1", "--max-tokens", "16"],
                          input="Name three rivers in Europe.\nWhich of them is the longest?\n", capture_output=True,
                          text=True, timeout=300)
    assert chat.returncode == 0, chat.stderr
    reused = [int(line.split("of which ")[1].split()[0]) for line in chat.stderr.splitlines() if "of which" in line]
    assert len(reused) == 2 and reused[1] >= len(first_ids) and chat.stdout.count("\n") >= 2


@slow
def test_logprobs_are_the_targets_streamed_or_not_spork_or_plain(api, client, reference):
    """chat logprobs + top_logprobs through Triton: per token the local plain decoding's log-probabilities (to fp32
    rounding), in spork and plain, streamed and not; the tokens spell the text; completions' legacy shape too."""
    from spork_trt.config import GenerateConfig

    _, model, _ = api
    for prompt in mt_bench_prompts(4):
        ids = reference.tok.encode_prompt(prompt)
        want = reference.rt.generate(ids, GenerateConfig(max_new_tokens=24), logprobs=3)
        kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0,
                  logprobs=True, top_logprobs=3)
        for mode in ("spork", "plain"):
            r = client.chat.completions.create(**kw, extra_body={"spec_mode": mode})
            got = r.choices[0].logprobs.content
            assert [g.token for g in got] == [reference.tok.token_bytes(t).decode("utf-8", "replace")
                                              for t in want.token_ids]
            assert "".join(bytes(g.bytes).decode("utf-8", "replace") for g in got) == want.text
            for g, w in zip(got, want.logprobs, strict=True):
                assert abs(g.logprob - w.logprob) <= 2e-6
                assert all(abs(a.logprob - v) <= 2e-6 for a, (_, v) in zip(g.top_logprobs, w.top, strict=True))
        chunks = client.chat.completions.create(**kw, stream=True)
        streamed_lp = [x.logprob for c in chunks if c.choices and c.choices[0].logprobs
                       for x in c.choices[0].logprobs.content]
        assert len(streamed_lp) == len(want.token_ids)
        assert all(abs(a - w.logprob) <= 2e-6 for a, w in zip(streamed_lp, want.logprobs))
    c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                  logprobs=2)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


@slow
def test_n_choices_greedy_identical_sampled_each_its_own_seed(api, client, reference):
    """n greedy choices are n copies of the greedy answer; n sampled choices with a seed are each the one-choice
    answer with seed + i (reproducible), streamed or not; usage counts every choice's tokens."""
    _, model, _ = api
    messages = [{"role": "user", "content": "Write one sentence about a cat."}]
    kw = dict(model=model, messages=messages, max_tokens=16)
    want, want_ids = reference(reference.tok.encode_prompt(messages[0]["content"]), 16)
    r = client.chat.completions.create(**kw, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and {c.message.content for c in r.choices} == {want}
    assert r.usage.completion_tokens == 3 * len(want_ids)
    sampled = client.chat.completions.create(**kw, temperature=1.0, seed=11, n=3)
    ones = [client.chat.completions.create(**kw, temperature=1.0, seed=11 + i) for i in range(3)]
    alone = [o.choices[0].message.content for o in ones]
    assert [c.message.content for c in sampled.choices] == alone and len(set(alone)) > 1  # each its own stream
    assert sampled.usage.completion_tokens == sum(o.usage.completion_tokens for o in ones)
    texts, finishes = ["", "", ""], [None] * 3
    for c in client.chat.completions.create(**kw, temperature=1.0, seed=11, n=3, stream=True):
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    assert texts == alone and all(finishes)
    done = client.completions.create(model=model, prompt="One, two,", max_tokens=8, temperature=0.7, seed=3, n=2)
    assert [c.index for c in done.choices] == [0, 1]


@slow
def test_response_format_json_schema_is_constrained_decoding_streamed_or_not(api, client, reference):
    """response_format json_schema (strict) through Triton: the answer parses, matches the schema and is the
    local constrained greedy decoding of the same prompt, streamed or not; json_object answers JSON."""
    import jsonschema

    from spork_trt.spec.grammar import GrammarSpec

    _, model, _ = api
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Name a large city and its country as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    kw = dict(model=model, messages=messages, max_tokens=64, temperature=0)
    r = client.chat.completions.create(**kw, response_format=fmt)
    hf = reference.tok.hf
    ids = hf.encode(hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)
    want, _ = reference(ids, 64, GrammarSpec("json_schema", json.dumps(schema)))
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(want), schema)
    text, finish, _, _ = streamed(client, "chat", **kw, response_format=fmt)
    assert (text, finish) == (want, "stop")
    plain = client.chat.completions.create(**kw, response_format=fmt, extra_body={"spec_mode": "plain"})
    assert plain.choices[0].message.content == want
    any_json = client.chat.completions.create(**kw, response_format={"type": "json_object"})
    json.loads(any_json.choices[0].message.content)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


@slow
def test_tool_call_round_trip_with_the_openai_client(api, client, reference):
    """`serve --chat-template generic`: tool_choice required -> tool_calls whose arguments validate against the
    function's schema, the local constrained greedy decoding of the same prompt, spork == plain, streamed == not;
    the call and its result sent back -> an answer in text; a named choice calls that function."""
    import jsonschema

    from spork_trt.serving.openai_api.generic_tools import generic_messages
    from spork_trt.serving.openai_api.tools import parse_tools

    _, model, _ = api
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    kw = dict(model=model, messages=messages, max_tokens=96, temperature=0)
    r = client.chat.completions.create(**kw, tools=[WEATHER], tool_choice="required")
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    tools = parse_tools({"tools": [WEATHER], "tool_choice": "required"})
    want, _ = reference(reference.tok.chat_ids(generic_messages(messages, tools.spec)), 96, tools.grammar)
    assert json.loads(want) == {"name": "get_weather", "arguments": args}
    plain = client.chat.completions.create(**kw, tools=[WEATHER], tool_choice="required",
                                           extra_body={"spec_mode": "plain"})
    assert plain.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    deltas, finish = [], None
    for c in client.chat.completions.create(**kw, tools=[WEATHER], tool_choice="required", stream=True):
        if c.choices:
            deltas += c.choices[0].delta.tool_calls or []
            finish = c.choices[0].finish_reason or finish
    assert finish == "tool_calls" and [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(0, "get_weather", call.function.arguments)]
    back = [*messages, ch.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, clear sky"}]
    answer = client.chat.completions.create(model=model, messages=back, tools=[WEATHER], tool_choice="none",
                                            max_tokens=32, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    named = client.chat.completions.create(**kw, tools=[WEATHER, CLOCK], tool_choice={
        "type": "function", "function": {"name": "get_time"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


@slow
def test_prefix_reuse_is_scoped_by_cache_salt(api, client):
    """A prompt's rows are reused by the next request with the same cache_salt only: another salt (another tenant)
    sees cached_tokens 0 and cannot confirm a guess at the first one's prompt; the text is the same either way."""
    _, model, _ = api
    kw = dict(model=model, prompt="Tenant A's private note: the vault code is 4471 and the meeting is at noon.",
              max_tokens=4, temperature=0)
    first = client.completions.create(**kw, extra_body={"cache_salt": "tenant-a"})
    other = client.completions.create(**kw, extra_body={"cache_salt": "tenant-b"})
    again = client.completions.create(**kw, extra_body={"cache_salt": "tenant-a"})
    n = first.usage.prompt_tokens
    assert [r.usage.prompt_tokens_details.cached_tokens for r in (first, other, again)] == [0, 0, n - 1]
    assert first.choices[0].text == other.choices[0].text == again.choices[0].text


@slow
def test_the_api_stops_with_serve(api, client):
    base, model, proc = api
    assert client.completions.create(model=model, prompt="Hello", max_tokens=4).choices[0].text  # still serving
    # the drain ends with exit code 0: nothing left in flight (a gRPC call cancelled AFTER its final response kept
    # Triton's spork model from unloading until the exit timeout; upstream.Stream cancels only answers cut short)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.err.read_text()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(base + "/health", timeout=5)


@slow
def test_a_full_queue_is_a_503_with_retry_after_and_the_others_are_answered(default_engines, tmp_path, reference):
    """One slot and a queue of one: of 6 requests sent at once, the first is decoded, one waits, and the rest are
    refused at once by the engine core's queue limit, which the API answers as OpenAI does a busy server (503,
    `Retry-After`, an error object); the answered ones are plain greedy's text."""
    from concurrent.futures import ThreadPoolExecutor

    from spork_trt.serving.triton_repo import RepoConfig, render

    repo = render(RepoConfig(default_engines, tmp_path / "repo", slots=1, max_queue=1))
    proc, base, model = start_serve(["--repo", str(repo), "--log", str(tmp_path / "triton.log")], tmp_path)
    # a prompt whose greedy text runs the whole budget, so that the six overlap (an instruction as a raw prompt,
    # "Write a short story about ...", got an empty text from the int4 target: the six then overlapped only in a
    # prefill, and once in CI none was refused)
    prompt, tokens = "Once upon a time, a lighthouse keeper", 256
    try:
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: post_completion(base, model, prompt, tokens), range(6)))
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
    codes = sorted(code for code, _, _ in answers)
    assert codes.count(503) >= 3 and set(codes) == {200, 503}, codes
    # serve stopped cleanly: the refused requests' streams were not cancelled after the refusal (which left them held
    # by Triton 2.51, and the stop waiting out its exit timeout)
    assert rc == 0, proc.err.read_text()[-2000:]
    want, want_ids = reference(reference.tok.encode_prompt(prompt, raw=True), tokens)
    assert len(want_ids) == tokens  # the premise: the first request decodes while the others arrive
    for code, headers, body in answers:
        if code == 503:
            assert int(headers["retry-after"]) >= 1
            assert body["error"]["type"] == "server_error" and "busy" in body["error"]["message"], body
        else:
            assert body["choices"][0]["text"] == want


def post_completion(base: str, model: str, prompt: str, tokens: int):
    """(status, headers by lower-case name, JSON body) of one non-streamed completion."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())
