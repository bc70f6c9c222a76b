"""The OpenAI API fuzzed from its own contract: schemathesis reads `/openapi.json` (the pydantic request models,
openai_api/schema.py) and sends requests that fit it (positive) and that break it (negative) to both POST routes,
the answers coming from a real tritonserver (`serve` on the default engines). Over at least 1,000 requests: no
answer is a 5xx (nor a streamed server error), every 4xx is OpenAI's error shape.

The front end runs in this process with a context of CONTEXT positions, so that a valid request asks for tens of
tokens, not thousands (the same code `serve` runs, on a smaller window: the suite's time)."""
from __future__ import annotations

import signal

import pytest

from tests.test_openai_api import start_serve
from tests.test_openai_edge import running

slow = pytest.mark.slow
CONTEXT = 96  # positions a request may use: the template's ~30, some text, some new tokens
EXAMPLES = 270  # per route and mode: 2 routes x 2 modes = 1,080 requests
ROUTES = ("/v1/chat/completions", "/v1/completions")


@pytest.fixture(scope="module")
def front(default_engines, default_tokenizer, tmp_path_factory):
    """(base URL) of an in-process front end over `serve`'s Triton."""
    from spork_trt.serving.openai_api.app import create_app
    from spork_trt.serving.openai_api.model import ServedModel

    proc, _, _ = start_serve(["--engines", str(default_engines), "--openai-port", "0"],
                             tmp_path_factory.mktemp("fuzz"))
    try:
        model = ServedModel("m", default_tokenizer, CONTEXT, 49152, "generic")
        with running(create_app(model, proc.grpc_url, 256 * 1024)) as port:
            yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def is_openai_error(body) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and bool(err["message"])


@slow
def test_fuzzed_requests_get_no_server_error_and_every_refusal_in_openais_shape(front):
    import requests
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(front + "/openapi.json")
    seen: dict[int, int] = {}  # status -> requests
    session = requests.Session()

    def check(case, served: bool) -> None:
        if served and isinstance(case.body, dict):  # the model this server serves (else nearly every case is a 404)
            case.body["model"] = "m"
        r = case.call(base_url=front, session=session, timeout=120)
        kind = (r.headers.get("content-type") or [""])[0]
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        where = f"{case.method} {case.path} {case.body!r:.600} -> {r.status_code} {r.text[:600]}"
        assert r.status_code < 500, where
        if r.status_code >= 400:
            assert kind == "application/json" and is_openai_error(r.json()), where
        elif kind.startswith("text/event-stream"):
            assert "server_error" not in r.text and r.text.endswith("data: [DONE]\n\n"), where

    for route in ROUTES:
        op = schema[route]["POST"]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            run = given(case=op.as_strategy(generation_mode=mode))(settings(
                max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=list(HealthCheck))(lambda case: check(case, mode == GenerationMode.POSITIVE)))
            run()
    total = sum(seen.values())
    assert total >= 1000, seen  # hypothesis may stop a strategy a little short of EXAMPLES
    assert seen.get(200, 0) >= 20, seen  # the answers' path was reached, not only refusals
    print(f"fuzzed {total} requests: {dict(sorted(seen.items()))}")
