"""A real tritonserver (the CPU build from nvidia-pytriton) serving the rendered repository on the default
engines: the same greedy text over every protocol as local generation, errors that name the problem while other
requests carry on, concurrent requests, cancellation, and `serve` shutting down on SIGTERM."""
from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from bench.soak import raw_infer
from spork_trt.serving.triton_client import ClientConfig, query
from spork_trt.errors import UserError
from spork_trt.serving.triton_server import ServerConfig, TritonServer, free_port
from tests.conftest import humaneval_prompts, mt_bench_prompts

pytestmark = pytest.mark.slow
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server(default_engines):
    cfg = ServerConfig(default_engines / "triton_repo", http_port=free_port(), grpc_port=free_port(),
                       metrics_port=free_port())
    s = TritonServer(cfg).start()
    try:
        yield s
    finally:
        code = s.stop()
    # every model unloaded within the drain (a cancelled unary request's unread BLS stream once kept spork_unary
    # loaded: Triton's exit timeout, exit code 1)
    assert code == 0, f"tritonserver did not stop cleanly (exit code {code}):\n{s.log_tail()}"


@pytest.fixture(scope="module")
def local(default_engines):
    """Plain greedy decoding on the same engines, in this process: the reference every served text must equal."""
    from spork_trt.config import GenerateConfig
    from spork_trt.config import AUTO_DTYPE
    from spork_trt.loop.runtime import Runtime

    rt = Runtime.from_engines(default_engines, dtype=AUTO_DTYPE)
    cache: dict[tuple[str, int], object] = {}

    def result(prompt: str, max_tokens: int = MAX_TOKENS):
        if (prompt, max_tokens) not in cache:
            ids = rt.tokenizer.encode_prompt(prompt)
            cache[prompt, max_tokens] = rt.generate(ids, GenerateConfig(max_new_tokens=max_tokens))
        return cache[prompt, max_tokens]

    def text(prompt: str, max_tokens: int = MAX_TOKENS) -> str:
        return result(prompt, max_tokens).text

    text.result, text.tok = result, rt.tokenizer
    return text


def cfg(server, protocol: str, stream: bool = False, **over) -> ClientConfig:
    url = server.grpc_url if protocol == "grpc" else server.http_url
    return ClientConfig(url=url, protocol=protocol, stream=stream, **{"max_tokens": MAX_TOKENS, **over})


PROTOCOLS = [("http", False), ("grpc", False), ("grpc", True), ("generate", False), ("generate", True)]


def test_same_greedy_text_over_every_protocol(server, local):
    for prompt in mt_bench_prompts(2) + humaneval_prompts(1):
        want = local(prompt)
        for protocol, stream in PROTOCOLS:
            reply = query(prompt, cfg(server, protocol, stream))
            assert reply.text == want, (protocol, stream, prompt[:40])
            st = reply.stats
            assert st["num_steps"] >= 1 and 0 <= st["total_accepted_draft_tokens"] <= st["total_draft_tokens"]
            assert st["mean_accepted_length"] >= 1 and reply.stop_reason in ("eos", "max_tokens")
            assert (reply.chunks > 1) == stream
    plain = query(prompt, cfg(server, "grpc", spec_mode="plain"))
    assert plain.text == want and plain.stats["total_draft_tokens"] == 0


def test_cli_generate_and_client_agree(server, default_engines):
    prompt = mt_bench_prompts(1)[0]
    def run(*a):
        return subprocess.run([sys.executable, "-m", "spork_trt", *a], capture_output=True, text=True, timeout=300)

    local = run("generate", prompt, "--engines", str(default_engines), "--max-new-tokens", str(MAX_TOKENS), "--json")
    assert local.returncode == 0, local.stderr
    served = run("client", prompt, "--url", server.grpc_url, "--stream", "--max-tokens", str(MAX_TOKENS))
    assert served.returncode == 0, served.stderr
    assert served.stdout == json.loads(local.stdout)["text"] + "\n"
    assert served.stderr.startswith("[triton] ") and "mean accepted length" in served.stderr
    down = run("client", "hi", "--url", f"127.0.0.1:{free_port()}", "--protocol", "generate")
    assert down.returncode == 2 and down.stderr.startswith("error: cannot reach Triton")


def test_model_control_and_admin_apis_are_closed(server, local):
    """Nobody who reaches the ports can unload a model (the service would be down) or load one (a python-backend
    model runs code in the server), over HTTP or gRPC; shared-memory registration and log settings need the
    operator's key, and so do the models' configurations (engine paths) and the statistics (other clients' counts).
    The service keeps answering afterwards."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    def post(path: str, body: dict | None = None, headers: dict | None = None) -> int:
        req = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body or {}).encode(),
                                     method="POST", headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    for name in ("spork", "ensemble", "preprocessing"):
        assert post(f"/v2/repository/models/{name}/unload") >= 400, name
    payload = {"parameters": {"config": json.dumps({"backend": "python"}), "file:1/model.py": "aW1wb3J0IG9z"}}
    assert post("/v2/repository/models/evil/load", payload) >= 400
    assert post("/v2/systemsharedmemory/region/r/register", {"key": "/x", "offset": 0, "byte_size": 8}) >= 400
    assert post("/v2/logging", {"log_verbose_level": 1}) >= 400
    for path in ("/v2/models/spork/config", "/v2/models/stats", "/v2/models/spork/stats"):
        try:
            with urllib.request.urlopen(f"http://{server.http_url}{path}", timeout=10) as r:
                got = r.status
        except urllib.error.HTTPError as e:
            got = e.code
        assert got >= 400, path
    with grpcclient.InferenceServerClient(server.grpc_url) as g:
        for call in (lambda: g.unload_model("spork"), lambda: g.load_model("spork"), lambda: g.get_model_config(
                "spork"), lambda: g.get_inference_statistics("spork")):
            with pytest.raises(InferenceServerException):
                call()
        assert g.is_model_ready("spork") and g.is_model_ready("ensemble")
    prompt = mt_bench_prompts(1)[0]
    assert query(prompt, cfg(server, "http")).text == local(prompt)


def test_bad_input_is_an_error_naming_the_problem_while_others_carry_on(server, local):
    prompt = mt_bench_prompts(3)[2]
    in_flight: dict = {}
    worker = threading.Thread(target=lambda: in_flight.update(reply=query(prompt, cfg(server, "grpc", True))))
    worker.start()
    for over, needle in [({"max_tokens": 0}, "max_tokens must be a positive"),
                         ({"max_tokens": 100_000}, "is beyond the context"),
                         ({"temperature": -1.0}, "temperature must be >= 0"),
                         ({"spec_mode": "warp"}, "unknown spec_mode 'warp'")]:
        for protocol, stream in PROTOCOLS:
            with pytest.raises(UserError, match=needle):
                query("hi", cfg(server, protocol, stream, **over))
    with pytest.raises(UserError, match="text_input is empty"):
        query("   ", cfg(server, "http"))
    t0 = time.monotonic()
    for protocol, stream in PROTOCOLS:  # 2 MB: refused by its size, before decoding or tokenizing (was 18-25 s)
        with pytest.raises(UserError, match="bytes: no text over"):
            query("a" * (2 << 20), cfg(server, protocol, stream))
    assert time.monotonic() - t0 < 30
    text = np.array([[b"hi"]], np.object_)
    assert "not valid UTF-8" in raw_infer(server, {"text_input": (np.array([[b"\xff\xfe"]], np.object_), "BYTES")})
    assert "data-type is 'FP32'" in raw_infer(server, {"text_input": (text, "BYTES"),
                                                       "max_tokens": (np.array([[8.0]], np.float32), "FP32")})
    assert "unexpected shape for input 'max_tokens'" in raw_infer(
        server, {"text_input": (text, "BYTES"), "max_tokens": (np.array([[8, 9]], np.int32), "INT32")})
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/generate",
                                 data=json.dumps({"text_input": "hi", "max_tokens": -2}).encode())
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400 and "max_tokens must be a positive" in e.value.read().decode()
    worker.join(timeout=300)
    assert in_flight["reply"].text == local(prompt)  # the request in flight was not disturbed
    assert query(prompt, cfg(server, "http")).text == local(prompt)  # and the server still serves


def stream_infer(server, model: str, inputs: dict[str, tuple[np.ndarray, str]]) -> list[dict[str, np.ndarray]]:
    """gRPC streaming with hand-made tensors: every response's outputs (raises the error response's message)."""
    import tritonclient.grpc as grpcclient

    tensors = []
    for name, (arr, dtype) in inputs.items():
        tensors.append(grpcclient.InferInput(name, list(arr.shape), dtype))
        tensors[-1].set_data_from_numpy(arr)
    responses: queue.Queue = queue.Queue()
    out = []
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        c.start_stream(callback=lambda result, error: responses.put((result, error)))
        c.async_stream_infer(model, tensors, enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=300)
            if error is not None:
                raise UserError(error.message())
            resp = result.get_response()
            if resp.outputs:
                out.append({o.name: result.as_numpy(o.name) for o in resp.outputs})
            if resp.parameters["triton_final_response"].bool_param:
                c.stop_stream()
                return out


def test_stop_words_end_the_request_and_tensorrt_llm_style_requests_are_served(server, local):
    """stop_words end a request in the engine core (stop_reason stop_string) with the text exactly up to the stop
    string, on every protocol; a request shaped as Triton's OpenAI frontend sends a TensorRT-LLM model (the fields of
    python/openai/openai_frontend/engine/utils/triton.py) is answered, its counts add up; what it cannot honour is
    refused naming the field; its text_input, a conversation it rendered with the chat template, is not templated
    again."""
    from spork_trt.serving.openai_api.stops import tokens_through_stop

    prompt = mt_bench_prompts(1)[0]
    want = local.result(prompt)
    stop = want.text[len(want.text) // 2:len(want.text) // 2 + 5]  # inside the answer, likely across tokens
    cut = want.text[:want.text.index(stop)]
    through = tokens_through_stop(want.token_ids, local.tok.decode, (stop,))
    for protocol, stream in PROTOCOLS:
        reply = query(prompt, cfg(server, protocol, stream, stop_words=(stop, "\u2603never")))
        assert (reply.text, reply.stop_reason) == (cut, "stop_string"), (protocol, stream)

    def one(value, dtype):
        return np.array([[value]], dtype), {np.float32: "FP32", np.int32: "INT32", np.uint64: "UINT64",
                                             np.bool_: "BOOL", np.object_: "BYTES"}[dtype]

    # that frontend renders the conversation with the model's chat template itself: it reaches the model once
    rendered = local.tok.hf.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                add_generation_prompt=True)
    frontend = {"text_input": one(rendered.encode(), np.object_), "stream": one(True, np.bool_),
                "max_tokens": one(MAX_TOKENS, np.int32), "stop_words": one(stop.encode(), np.object_),
                "top_p": one(1.0, np.float32), "frequency_penalty": one(0.0, np.float32),
                "presence_penalty": one(0.0, np.float32), "seed": one(5, np.uint64),
                "temperature": one(0.0, np.float32), "exclude_input_in_output": one(True, np.bool_),
                "return_num_input_tokens": one(True, np.bool_), "return_num_output_tokens": one(True, np.bool_)}
    for stream in (True, False):
        out = stream_infer(server, "ensemble", {**frontend, "stream": one(stream, np.bool_)})
        assert "".join(o["text_output"][0, 0].decode() for o in out) == cut and (len(out) > 1) == stream
        assert sum(int(o["num_output_tokens"][0, 0]) for o in out) == through
        assert int(out[-1]["num_input_tokens"][0, 0]) == len(local.tok.encode_prompt(prompt))
    older = {k: v for k, v in frontend.items() if k not in ("seed", "stop_words")}  # before 2.59: random_seed
    out = stream_infer(server, "ensemble", {**older, "random_seed": one(5, np.uint64),
                                           "temperature": one(1.0, np.float32)})  # OpenAI's default temperature
    sampled = "".join(o["text_output"][0, 0].decode() for o in out)
    assert out[-1]["stop_reason"][0, 0] in (b"eos", b"max_tokens") and len(sampled) > 0
    with pytest.raises(UserError, match=re.escape("frequency_penalty=0.5 is not supported by this server")):
        stream_infer(server, "ensemble", {**frontend, "frequency_penalty": one(0.5, np.float32)})


def test_16_concurrent_streaming_clients_get_their_own_answers(server, local):
    prompts = mt_bench_prompts(12)[4:12] + humaneval_prompts(8)  # 16 different prompts
    streams = [("grpc", True), ("generate", True)]
    got: dict[int, str] = {}

    def one(k: int) -> None:
        got[k] = query(prompts[k], cfg(server, *streams[k % 2], max_tokens=16)).text

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert [got.get(k) for k in range(len(prompts))] == [local(p, 16) for p in prompts]


def near_tie(rt, prompt: str, served: str, max_tokens: int) -> float | None:
    """Where a served text differs from plain greedy decoding alone: the target's top-2 logit gap at the first
    differing token (batched arithmetic may round differently; below 1e-4 that flips a tie, not a bug)."""
    import torch

    from spork_trt.config import GenerateConfig
    from spork_trt.engines import prefill

    ids = rt.tokenizer.encode_prompt(prompt)
    want = rt.generate(ids, GenerateConfig(max_new_tokens=max_tokens)).token_ids
    k = next(k for k in range(len(want)) if not served.startswith(rt.tokenizer.decode(want[:k + 1])))
    top = torch.topk(prefill(rt.engine, rt.engine.make_cache(len(ids) + k + 1), ids + want[:k]).float(), 2).values  # the target's logits there
    return float(top[0] - top[1])


def test_32_concurrent_mixed_requests_are_lossless_under_batching(server, default_engines):
    """32 requests at once (mixed prompts, lengths, spork and plain; more than the server's slots, so some queue):
    each greedy text equals plain greedy decoding of the same request alone; sampled requests with a seed draw the
    same text batched as alone (one at a time through the same server)."""
    from concurrent.futures import ThreadPoolExecutor

    from spork_trt.config import GenerateConfig
    from spork_trt.config import AUTO_DTYPE
    from spork_trt.loop.runtime import Runtime

    rt = Runtime.from_engines(default_engines, dtype=AUTO_DTYPE)
    prompts = mt_bench_prompts(16) + humaneval_prompts(16)
    lengths = [8, 16, 24, 32, 48]
    jobs = [(prompts[k], lengths[k % 5], "plain" if k % 4 == 3 else "spork", None) for k in range(28)]
    jobs += [(prompts[k], 24, "spork", k) for k in range(28, 32)]  # sampled: temperature 0.8, seed k
    sampled = lambda j: {"temperature": 0.8, "seed": j[3]} if j[3] is not None else {}  # noqa: E731

    def ask(j) -> str:
        return query(j[0], cfg(server, "grpc", True, max_tokens=j[1], spec_mode=j[2], **sampled(j))).text

    counters = ("spork_steps_total", "spork_active_request_steps_total")
    before = [spork_metric(server, n) for n in counters]  # the module's earlier tests stepped on this server too
    with ThreadPoolExecutor(32) as pool:
        batched = list(pool.map(ask, jobs))
    time.sleep(1.5)  # the metrics are published twice a second
    steps, request_steps = (spork_metric(server, n) - b for n, b in zip(counters, before))
    ties = []
    for j, text in zip(jobs, batched):
        if j[3] is not None:
            assert text == ask(j), j  # alone: the server is idle now
            continue
        want = rt.generate(rt.tokenizer.encode_prompt(j[0]), GenerateConfig(max_new_tokens=j[1])).text
        if text != want:
            gap = near_tie(rt, j[0], text, j[1])
            assert gap < 1e-4, (j, gap, text, want)
            ties.append((j[0][:40], gap))
    print(f"near-ties counted as identical: {ties}")
    assert steps > 0 and request_steps / steps > 2, (steps, request_steps)  # the core stepped the burst together
    deadline = time.monotonic() + 10
    while spork_metric(server, "spork_active_requests") or spork_metric(server, "spork_queued_requests"):
        assert time.monotonic() < deadline, "slots still in use after every request was answered"
        time.sleep(0.2)


def spork_metric(server, name: str) -> float:
    """One of the spork model's own Prometheus metrics, summed over its instances."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.cfg.metrics_port}/metrics", timeout=30) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith(name + "{"))


def counters(server, model: str) -> tuple[float, float]:
    """Triton's own counts of a model's requests: (nv_inference_request_success, nv_inference_request_failure)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.cfg.metrics_port}/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    return tuple(sum(float(line.rsplit(" ", 1)[1]) for line in lines
                     if line.startswith(name + "{") and f'model="{model}"' in line)
                 for name in ("nv_inference_request_success", "nv_inference_request_failure"))


def test_100_bad_requests_among_good_ones(server, local):
    """Bad requests of every kind, interleaved with good ones from 8 clients at once: each bad one gets an error
    that names its problem, each good one the right text, and Triton's own counters agree: `ensemble` counts the
    bad ones as failures; `ensemble_unary`, a python model, counts every request once (an error answer as a success:
    python_backend 24.10 reports a request failed only when execute raises)."""
    from concurrent.futures import ThreadPoolExecutor

    bad_kinds = [({"max_tokens": 0}, "max_tokens must be a positive"),
                 ({"max_tokens": 100_000}, "is beyond the context"),
                 ({"temperature": -2.0}, "temperature must be >= 0"),
                 ({"top_p": 1.5}, "top_p must be in (0, 1]"),
                 ({"spec_mode": "warp"}, "unknown spec_mode 'warp'")]
    protocols = PROTOCOLS[:2] + PROTOCOLS[3:]  # every entry point, streaming or not
    good_prompts = mt_bench_prompts(4)
    want = {p: local(p, 8) for p in good_prompts}  # computed here: the local runtime serves one thread
    jobs = [("bad", k) for k in range(100)]
    for k in range(len(good_prompts) * 2):  # a good one about every 12 bad ones
        jobs.insert(k * 13 + 6, ("good", k))
    before = {m: counters(server, m) for m in ("ensemble", "ensemble_unary")}

    def run(job) -> bool:
        kind, k = job
        protocol, stream = protocols[k % len(protocols)]
        if kind == "good":
            prompt = good_prompts[k % len(good_prompts)]
            return query(prompt, cfg(server, protocol, stream, max_tokens=8)).text == want[prompt]
        over, needle = bad_kinds[k % len(bad_kinds)]
        if k % 10 == 9:
            over, needle = {}, "text_input is empty"
        try:
            query("" if not over else "hi", cfg(server, protocol, stream, **over))
        except UserError as e:
            return needle in str(e)
        return False

    with ThreadPoolExecutor(8) as pool:
        ok = list(pool.map(run, jobs))
    assert all(ok), [j for j, good in zip(jobs, ok) if not good]
    with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=30) as r:
        assert r.status == 200
    streamed = [kind for kind, k in jobs if protocols[k % len(protocols)][0] == "generate"]  # through `ensemble`
    want_counts = (streamed.count("good"), streamed.count("bad"), len(jobs) - len(streamed))
    got = settled_counts(server, before, want_counts)
    assert got[0] == want_counts[0] and got[1] >= want_counts[1] and got[2] == want_counts[2], (got, want_counts)


def settled_counts(server, before, want, wait_s: float = 15.0) -> tuple[float, float, float]:
    """(ensemble successes, ensemble failures, ensemble_unary requests) since `before`, read until they reach `want`
    or `wait_s` passes: Triton records a request's outcome after it sends the final response, so a client can hold
    its last answer a moment before the counter moves (CI saw 3 of 4 successes read at once)."""
    deadline = time.monotonic() + wait_s
    while True:
        delta = {m: [now - then for now, then in zip(counters(server, m), before[m])]
                 for m in ("ensemble", "ensemble_unary")}
        got = (delta["ensemble"][0], delta["ensemble"][1], sum(delta["ensemble_unary"]))
        if (got[0] >= want[0] and got[1] >= want[1] and got[2] >= want[2]) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_cancelled_stream_frees_its_request(server, default_tokenizer):
    """A cancelled gRPC stream to `spork` itself leaves the engine core at the next step (a stream to `ensemble` would
    not: Triton 2.51 checks an ensemble's cancellation between steps only; docs/serving.md)."""
    import tritonclient.grpc as grpcclient

    ids = np.array([default_tokenizer.encode_prompt("Write a long story about a dragon.")], np.int32)
    inputs = [grpcclient.InferInput("input_ids", list(ids.shape), "INT32"),
              grpcclient.InferInput("max_tokens", [1, 1], "INT32"), grpcclient.InferInput("stream", [1, 1], "BOOL")]
    for t, v in zip(inputs, (ids, np.array([[500]], np.int32), np.array([[True]]))):
        t.set_data_from_numpy(v)
    responses: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: responses.put((result, error)))
    c.async_stream_infer("spork", inputs)
    for _ in range(3):
        result, error = responses.get(timeout=120)
        assert error is None
    c.stop_stream(cancel_requests=True)
    c.close()
    deadline = time.monotonic() + 30
    while "request cancelled, its KV slot released" not in server.cfg.log.read_text():
        assert time.monotonic() < deadline, "the cancelled request was not stopped"
        time.sleep(0.2)


def cancelled_beside_another(server, model: str, long: dict[str, np.ndarray], other: dict[str, np.ndarray]):
    """gRPC ModelInfer to `model`: `long` cancelled by its client about 1 s after the engine core took the requests,
    `other` sent beside it. Both answers, (result, error) by name, once the cancelled request has left the engine core
    (its slot released within 10 s: else it runs on with nobody listening)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    def tensors(values: dict[str, np.ndarray]) -> list:
        out = [grpcclient.InferInput(k, list(v.shape), np_to_triton_dtype(v.dtype)) for k, v in values.items()]
        for t, v in zip(out, values.values()):
            t.set_data_from_numpy(v)
        return out

    answers: queue.Queue = queue.Queue()
    released = server.cfg.log.read_text().count("request cancelled, its KV slot released")
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        handle = c.async_infer(model, tensors(long), lambda result, error: answers.put(("long", result, error)))
        c.async_infer(model, tensors(other), lambda result, error: answers.put(("other", result, error)))
        deadline = time.monotonic() + 60
        while spork_metric(server, "spork_active_requests") < 1:
            assert time.monotonic() < deadline, "the requests never started"
            time.sleep(0.2)
        time.sleep(1)
        handle.cancel()
        got = dict((name, (result, error)) for name, result, error in (answers.get(timeout=120) for _ in range(2)))
    assert got["long"][0] is None and "cancel" in str(got["long"][1]).lower()
    deadline = time.monotonic() + 10
    while server.cfg.log.read_text().count("request cancelled, its KV slot released") == released or \
            spork_metric(server, "spork_active_requests"):
        assert time.monotonic() < deadline, "the cancelled request runs on"
        time.sleep(0.2)
    return got


def test_a_cancelled_unary_request_frees_its_slot_while_another_is_served(server, local):
    """gRPC ModelInfer to spork_unary, cancelled by its client: Triton 2.51 cannot cancel spork_unary's BLS call, so
    spork_unary sends `spork` a cancel carrying the request's key and the request leaves the batch at the next step;
    a request sent beside it gets plain greedy's tokens all the same."""
    def ids(prompt: str) -> np.ndarray:
        return np.array([local.tok.encode_prompt(prompt)], np.int32)

    other = mt_bench_prompts(1)[0]
    got = cancelled_beside_another(
        server, "spork_unary", {"input_ids": ids("Write a long story about a dragon."),
                                "max_tokens": np.array([[1500]], np.int32)},
        {"input_ids": ids(other), "max_tokens": np.array([[MAX_TOKENS]], np.int32)})
    result, error = got["other"]
    assert error is None and result.as_numpy("output_ids")[0].tolist() == local.result(other).token_ids
    nobodys = np.array([[b"0" * 32]], np.object_)  # a cancel of no request: answered with an empty final response
    assert stream_infer(server, "spork", {"cancel_key": (nobodys, "BYTES")}) == []
    with pytest.raises(UserError, match="^cancel_key must be 32 lowercase hex digits"):
        stream_infer(server, "spork", {"cancel_key": (np.array([[b"../x"]], np.object_), "BYTES")})


def test_a_cancelled_ensemble_unary_request_frees_its_slot_while_another_is_served(server, local):
    """gRPC ModelInfer to ensemble_unary (text in, what `client` sends without --stream), cancelled by its client: an
    ensemble's cancellation Triton 2.51 checks only between steps, so ensemble_unary is a python model making the
    steps' calls itself, and its spork call carries a cancel key as spork_unary's does: the request leaves the
    engine core at its next step, and a request sent beside it gets plain greedy's text all the same."""
    def text(prompt: str) -> np.ndarray:
        return np.array([[prompt.encode()]], np.object_)

    other = mt_bench_prompts(1)[0]
    got = cancelled_beside_another(
        server, "ensemble_unary", {"text_input": text("Write a long story about a dragon."),
                                   "max_tokens": np.array([[1500]], np.int32)},
        {"text_input": text(other), "max_tokens": np.array([[MAX_TOKENS]], np.int32)})
    result, error = got["other"]
    assert error is None and result.as_numpy("text_output")[0, 0].decode() == local(other)


def test_bad_fields_sent_to_the_unary_models_are_a_400_naming_them(server):
    """The BLS calls inside the unary models hand them every error as INTERNAL: the code is found again from the
    message (io_spec.error_kind), so a bad field stays a 400 (and a full queue a 503), whichever step refused it."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    def refusal(model: str, values: dict[str, np.ndarray]):
        tensors = [httpclient.InferInput(k, list(v.shape), np_to_triton_dtype(v.dtype)) for k, v in values.items()]
        for t, v in zip(tensors, values.values()):
            t.set_data_from_numpy(v)
        with httpclient.InferenceServerClient(server.http_url) as c, pytest.raises(InferenceServerException) as e:
            c.infer(model, tensors)
        return e.value.status(), e.value.message()

    status, message = refusal("spork_unary", {"input_ids": np.array([[5, 10 ** 9]], np.int32)})
    assert status == "400" and message.startswith("input_ids must be token ids")
    hi, zero = np.array([[b"hi"]], np.object_), np.array([[0]], np.int32)
    status, message = refusal("ensemble_unary", {"max_tokens": zero})  # refused by preprocessing
    assert status == "400" and message.startswith("text_input is missing")
    status, message = refusal("ensemble_unary", {"text_input": hi, "max_tokens": zero})  # by spork
    assert status == "400" and message.startswith("max_tokens must be a positive")
    status, message = refusal("ensemble_unary", {"text_input": hi, "stream": np.array([[True]])})
    assert status == "400" and message.startswith("stream=true needs the streaming model `ensemble`")


def test_serve_command_starts_and_stops_on_sigterm(default_engines, tmp_path):
    ports = [str(free_port()) for _ in range(3)]
    p = subprocess.Popen([sys.executable, "-m", "spork_trt", "serve", "--engines", str(default_engines),
                          "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2],
                          "--openai-port", str(free_port()), "--log", str(tmp_path / "triton.log")], stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not any(line.startswith("ready:") for line in lines):
            lines.append(p.stderr.readline())
            assert lines[-1] or p.poll() is None, "".join(lines)
        assert f"HTTP 127.0.0.1:{ports[0]}" in lines[-1] and f"gRPC 127.0.0.1:{ports[1]}" in lines[-1]
        assert query("Say hi.", ClientConfig(url=f"127.0.0.1:{ports[0]}", protocol="generate", max_tokens=4)).text
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 0
    finally:
        p.kill()
    with pytest.raises(UserError, match="cannot reach Triton"):
        query("hi", ClientConfig(url=f"127.0.0.1:{ports[0]}", protocol="generate"))


@pytest.mark.parametrize("dtype", ["onnx", "fp32", "bf16"])
def test_a_repository_on_the_device_engine_serves_the_same_text(default_engines, tmp_path, dtype):
    """A repository on another target than the build's default (which the module's server runs: int4 on the CPU
    torch engine where the CPU has oneDNN's bf16 kernels, else the ONNX target): `export triton --device onnx`, or
    `--device cpu` (fp32: the gpu profile's device engine, its code run eagerly on the CPU; bf16: the CPU torch
    engine). A real tritonserver answers over gRPC streaming and HTTP with that target's own plain greedy text,
    speculating (spork, the build's datastore)."""
    from spork_trt.config import GenerateConfig
    from spork_trt.engines.cpu.engine import onednn_bf16_available
    from spork_trt.loop.runtime import Runtime
    from spork_trt.serving.triton_repo import RepoConfig, render

    if dtype == "bf16" and not onednn_bf16_available():
        pytest.skip("this CPU has no oneDNN bf16 kernels (AVX512-BF16 or AMX)")
    device, dtype = ("", "fp32") if dtype == "onnx" else ("cpu", dtype)
    repo = render(RepoConfig(default_engines, tmp_path / "repo", slots=2, device=device, dtype=dtype))
    rt = Runtime.from_engines(default_engines, device=device or None, dtype=dtype)
    drafted = 0
    with TritonServer(ServerConfig(repo, http_port=free_port(), grpc_port=free_port(),
                                   metrics_port=free_port())) as s:
        for prompt in mt_bench_prompts(1) + humaneval_prompts(1):
            want = rt.generate(rt.tokenizer.encode_prompt(prompt), GenerateConfig(max_new_tokens=MAX_TOKENS),
                               mode="plain").text
            for protocol, stream in (("grpc", True), ("http", False)):
                reply = query(prompt, cfg(s, protocol, stream))
                assert reply.text == want, (protocol, prompt[:40])
                drafted += reply.stats["total_draft_tokens"]
    assert drafted > 0  # the build's datastore drafts for it (the draft switch may stop where it does not pay)


def test_ready_waits_for_the_metrics_endpoint(tmp_path):
    """Triton starts its metrics service after the HTTP one: `start` returns only once both answer (a test that read
    readiness and then scraped the metrics found nobody listening). Stand-ins: two local HTTP servers, the metrics
    one started 1 s late, and a sleeping process as the server."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    ready, metrics = free_port(), free_port()
    servers = [ThreadingHTTPServer(("127.0.0.1", ready), Ok)]
    threading.Thread(target=servers[0].serve_forever, daemon=True).start()

    late_server = ThreadingHTTPServer(("127.0.0.1", metrics), Ok, bind_and_activate=False)
    late_server.allow_reuse_address = True
    late_server.server_bind()  # the port held now (refusing connections until it listens): no other process takes it

    def late():
        time.sleep(1.0)
        late_server.server_activate()
        servers.append(late_server)
        late_server.serve_forever()
    threading.Thread(target=late, daemon=True).start()
    s = TritonServer.__new__(TritonServer)
    s.cfg = ServerConfig(tmp_path, http_port=ready, grpc_port=free_port(), metrics_port=metrics, ready_timeout_s=20)
    s.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        t0 = time.monotonic()
        s.wait_ready()
        assert time.monotonic() - t0 >= 0.9
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
            assert r.status == 200
    finally:
        s.proc.kill()
        for srv in servers:
            srv.shutdown()


def test_ctrl_c_while_starting_leaves_nothing_running(default_engines, tmp_path):
    """SIGINT before the server is ready: the launcher exits 130 and no process of the server's group (tritonserver,
    its python backend stubs) is left holding the ports."""
    import os

    import psutil

    def name_of(proc) -> str:  # a child that exits between the listing and the read (a short-lived helper) has none
        try:
            return proc.name()
        except psutil.Error:
            return ""

    ports = [str(free_port()) for _ in range(3)]
    p = subprocess.Popen([sys.executable, "-m", "spork_trt", "serve", "--engines", str(default_engines),
                          "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2],
                          "--openai-port", str(free_port()), "--log", str(tmp_path / "triton.log")], stderr=(tmp_path / "launcher.err").open("w"),
                         text=True)  # a file, not a pipe nobody reads: a full pipe would block the launcher
    try:
        deadline, server = time.monotonic() + 120, None
        while server is None:
            assert time.monotonic() < deadline and p.poll() is None, "tritonserver did not start"
            kids = [c for c in psutil.Process(p.pid).children(recursive=True) if "tritonserver" in name_of(c)]
            server = kids[0].pid if kids else None
            time.sleep(0.1)
        group = os.getpgid(server)  # the guard's (triton_guard.py)
        while "python" not in " ".join(name_of(c) for c in psutil.Process(server).children()):
            assert time.monotonic() < deadline, "no python backend stub started"
            time.sleep(0.1)  # a stub is loading a model: the moment the stubs used to be left behind
        p.send_signal(signal.SIGINT)
        try:
            code = p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 130, (code, (tmp_path / "launcher.err").read_text()[-2000:])
    finally:
        p.kill()

    def in_group(proc) -> bool:
        try:
            return os.getpgid(proc.pid) == group and proc.status() != psutil.STATUS_ZOMBIE
        except (ProcessLookupError, psutil.Error):
            return False

    assert not [q.info for q in psutil.process_iter(["pid", "name"]) if in_group(q)]


def test_the_unary_queue_is_bounded_and_a_batch_of_unary_requests_is_served_concurrently(default_engines, tmp_path,
                                                                                          local):
    """`ensemble_unary`: Triton's queue in front of it holds at most --max-queue requests (here 1, with one
    ensemble_unary instance); beyond that a request is refused at once as unavailable instead of waiting unbounded,
    and the requests one instance takes together are answered concurrently with plain greedy's text."""
    from concurrent.futures import ThreadPoolExecutor

    from spork_trt.serving.triton_repo import RepoConfig, render

    repo = render(RepoConfig(default_engines, tmp_path / "repo", slots=16, max_queue=1, unary_instances=1))
    prompts = mt_bench_prompts(12)
    scfg = ServerConfig(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                        log_file=tmp_path / "triton.log")

    def ask(prompt: str):
        t = time.perf_counter()
        try:
            return prompt, query(prompt, cfg(s, "http", retries=0)).text, time.perf_counter() - t
        except UserError as e:
            return prompt, e, time.perf_counter() - t

    with TritonServer(scfg) as s, ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts))
    refused = [(p, a, dt) for p, a, dt in answers if isinstance(a, Exception)]
    served = [(p, a, dt) for p, a, dt in answers if not isinstance(a, Exception)]
    assert len(refused) >= 3 and len(served) >= 2, [str(a)[:80] for _, a, _ in answers]
    assert all("queue" in str(a) for _, a, _ in refused), [str(a) for _, a, _ in refused]
    assert max(dt for _, _, dt in refused) < min(dt for _, _, dt in served)  # refused at once, not after waiting
    for p, text, _ in served:
        assert text == local(p)


def test_cancels_reach_either_spork_instance_and_the_server_stops_cleanly(default_engines, tmp_path, local):
    """Two `spork` instances (each its own engine core): a cancelled `spork_unary` request leaves whichever core runs
    it, wherever Triton sends the cancel (the cancel board, spork_trt/serving/cancel_board.py); the request beside it gets
    plain greedy's tokens; and the server then stops cleanly (every model unloaded)."""
    from spork_trt.serving.triton_repo import RepoConfig, render

    repo = render(RepoConfig(default_engines, tmp_path / "repo", instances=2, slots=4))
    s = TritonServer(ServerConfig(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                  log_file=tmp_path / "triton.log")).start()
    try:
        for other in mt_bench_prompts(3):  # three times: Triton picks the instance of each request and of each cancel
            ids = np.array([local.tok.encode_prompt(f"Write a long story about {other[:40]}")], np.int32)
            got = cancelled_beside_another(
                s, "spork_unary", {"input_ids": ids, "max_tokens": np.array([[1500]], np.int32)},
                {"input_ids": np.array([local.tok.encode_prompt(other)], np.int32),
                 "max_tokens": np.array([[MAX_TOKENS]], np.int32)})
            assert got["other"][0].as_numpy("output_ids")[0].tolist() == local.result(other).token_ids
    finally:
        code = s.stop()
    assert code == 0, s.log_tail()
