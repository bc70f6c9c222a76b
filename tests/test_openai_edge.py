"""The OpenAI API's edge without Triton behind it (nothing here reaches the upstream): a body past the limit is a 413
in OpenAI's shape, refused by its Content-Length or while it streams in; JSON that Python cannot take (an integer
literal of 5,000 digits, 30,000 nested brackets) is a 400, never a 500. A real uvicorn server, raw HTTP."""
from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time

import pytest

LIMIT = 64 * 1024


@contextlib.contextmanager
def running(app):
    """`app` on a real uvicorn server on a free loopback port: yields the port."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def served_model(tokenizer):
    from spork_trt.serving.openai_api.model import ServedModel

    return ServedModel("m", tokenizer, 1024, 49152)


@pytest.fixture(scope="module")
def api(default_tokenizer):
    from spork_trt.serving.openai_api.app import create_app

    with running(create_app(served_model(default_tokenizer), "127.0.0.1:1", LIMIT)) as port:  # no upstream
        yield port


def post(port: int, body: bytes, chunked: bool = False) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if chunked:
        conn.request("POST", "/v1/completions", body=iter([body[i:i + 8192] for i in range(0, len(body), 8192)]),
                     headers=headers, encode_chunked=True)
    else:
        conn.request("POST", "/v1/completions", body=body, headers=headers)
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_past_the_limit_is_a_413_in_openais_shape(api, chunked):
    body = json.dumps({"model": "m", "prompt": "x" * (2 * LIMIT)}).encode()
    status, err = post(api, body, chunked)
    assert status == 413 and err["error"]["code"] == "request_too_large" and str(LIMIT) in err["error"]["message"]
    assert set(err["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body,needle", [
    (b'{"model": "m", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b"[" * 30000 + b"]" * 30000, "nests"),
    (b"\xff\xfe not utf-8", "not valid JSON"),
])
def test_json_python_cannot_take_is_a_400(api, body, needle):
    status, err = post(api, body)
    assert status == 400 and needle in err["error"]["message"] and err["error"]["type"] == "invalid_request_error"
