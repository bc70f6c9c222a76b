"""Who may call the OpenAI API (openai_api/gate.py), on a real uvicorn server with raw HTTP and the real `openai`
client: without the key, or with another, a 401 in OpenAI's shape (the SDK raises AuthenticationError); /health
open unless asked; a web page's requests (an Origin, a text/plain or form body, a rebound Host name) are refused
before the body is read. Each of these passed unchecked before the gate (issue 61, item 4)."""
from __future__ import annotations

import http.client
import json

import pytest

from spork_trt.serving.openai_api.gate import GateConfig, gate_config, host_name, key_matches
from tests.test_openai_edge import running, served_model

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def keyed(default_tokenizer):
    from spork_trt.serving.openai_api.app import create_app

    gate = gate_config("127.0.0.1", [KEY, "second-key"], None, ["https://chat.example.com"])
    with running(create_app(served_model(default_tokenizer), "127.0.0.1:1", 4096, gate)) as port:  # no upstream
        yield port


def call(port: int, method: str, path: str, headers: dict, body: bytes | None = None) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(method, path, body=body, headers=headers)
    r = conn.getresponse()
    out = r.status, json.loads(r.read()), dict(r.getheaders())
    conn.close()
    return out


def test_without_the_key_or_with_another_a_401_in_openais_shape(keyed):
    for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                 {"Authorization": f"Bearer {KEY}x"}):
        status, err, headers = call(keyed, "GET", "/v1/models", auth)
        assert status == 401 and err["error"]["code"] == "invalid_api_key", auth
        assert set(err["error"]) == {"message", "type", "param", "code"} and headers["www-authenticate"] == "Bearer"
    for key in (KEY, "second-key"):
        status, body, _ = call(keyed, "GET", "/v1/models", {"Authorization": f"Bearer {key}"})
        assert status == 200 and body["data"][0]["id"] == "m"


def test_health_is_open_without_a_key_unless_asked(keyed, default_tokenizer):
    from spork_trt.serving.openai_api.app import create_app

    status, body, _ = call(keyed, "GET", "/health", {})
    assert status == 503 and body == {"status": "unavailable"}  # past the gate: no Triton behind it here
    closed = gate_config("127.0.0.1", [KEY], None, None, open_health=False)
    with running(create_app(served_model(default_tokenizer), "127.0.0.1:1", 4096, closed)) as port:
        assert call(port, "GET", "/health", {})[0] == 401
        assert call(port, "GET", "/health", {"Authorization": f"Bearer {KEY}"})[0] == 503


def test_the_openai_client_with_the_key_passes_and_without_it_raises_authentication_error(keyed):
    import openai

    good = openai.OpenAI(base_url=f"http://127.0.0.1:{keyed}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list()] == ["m"]
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{keyed}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="m", prompt="hi", max_tokens=1)


@pytest.mark.parametrize("headers,status,code", [
    ({"Origin": "https://evil.example"}, 403, "origin_not_allowed"),  # a web page's fetch()
    ({"Origin": "null"}, 403, "origin_not_allowed"),  # a sandboxed frame, a file:// page
    ({"Host": "attacker.example:9000"}, 403, "host_not_allowed"),  # DNS rebinding: the page's own name
    ({"Content-Type": "text/plain"}, 415, "unsupported_media_type"),  # a "simple" cross-site POST
    ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),  # a form
])
def test_a_web_pages_requests_are_refused_before_the_body_is_read(keyed, headers, status, code):
    base = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode()
    got, err, _ = call(keyed, "POST", "/v1/completions", base | headers, body)
    assert (got, err["error"]["code"]) == (status, code)


def test_an_allowed_origin_and_loopback_names_pass_the_gate(keyed):
    for headers in ({"Origin": "https://chat.example.com"}, {"Host": "localhost:1"}, {"Host": "[::1]:9000"}):
        status, _, _ = call(keyed, "GET", "/v1/models", {"Authorization": f"Bearer {KEY}"} | headers)
        assert status == 200, headers


def test_the_gate_config_from_flags_and_environment(monkeypatch):
    monkeypatch.setenv("SPORK_API_KEY", "from-env")
    cfg = gate_config("0.0.0.0", ["a"], None, None)
    assert cfg.api_keys == ("a", "from-env") and cfg.allowed_hosts is None  # beyond loopback: any Host
    assert gate_config("127.0.0.1", None, None, None).allowed_hosts == GateConfig().allowed_hosts | {"127.0.0.1"}
    assert gate_config("::1", None, ["*"], None).allowed_hosts is None
    assert gate_config("127.0.0.1", None, ["API.Example"], None).allowed_hosts == {"api.example"}
    monkeypatch.delenv("SPORK_API_KEY")
    with pytest.raises(ValueError, match="empty"):
        gate_config("127.0.0.1", [" "], None, None)
    assert [host_name(h) for h in ("[::1]:9000", "Example:80", "::1", "localhost")] == ["::1", "example", "::1",
                                                                                         "localhost"]
    assert key_matches("b", ("a", "b")) and not key_matches("", ("a",)) and not key_matches("a", ())
