"""Who may call the OpenAI API, checked before a route reads a byte of the body (a pure ASGI middleware: answers,
streamed or not, pass through it untouched):

- the Host a request names is one of `allowed_hosts` (by default, on a loopback bind, only loopback names: a web
  page that rebinds its own DNS name to 127.0.0.1 cannot reach the API);
- a browser's request (it carries an Origin) comes from one of `allowed_origins` (none by default: a web page a user
  opens cannot POST to the API);
- a POST's body is declared JSON (a page's form or `text/plain` POST, which a browser sends without asking, is a
  415);
- with API keys set, `Authorization: Bearer KEY` names one of them (compared in constant time; /health open unless
  `open_health` is off), else a 401.
Each refusal is OpenAI's error shape (errors.ApiError)."""
from __future__ import annotations

import hmac
import ipaddress
import os
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from spork_trt.serving.openai_api.errors import ApiError

KEY_ENV = "SPORK_API_KEY"  # an API key from the environment (as vLLM's VLLM_API_KEY, llama-server's LLAMA_API_KEY)
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
OPEN_PATHS = frozenset({"/health"})  # open without a key unless GateConfig.open_health is off


@dataclass(frozen=True)
class GateConfig:
    api_keys: tuple[str, ...] = ()  # none: no key is asked for
    allowed_hosts: frozenset[str] | None = LOOPBACK_NAMES  # Host names (without the port) accepted; None: any
    allowed_origins: frozenset[str] = frozenset()  # browser Origins accepted; a request without one passes
    open_health: bool = True  # /health answers without a key (probes, load balancers)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def gate_config(bind: str, keys: list[str] | None, hosts: list[str] | None, origins: list[str] | None,
                open_health: bool = True) -> GateConfig:
    """The gate for an API bound to `bind`: keys from the flags and $SPORK_API_KEY; the Host allow-list given (`*`:
    any), else loopback names on a loopback bind and any elsewhere."""
    all_keys = [*(keys or []), *([os.environ[KEY_ENV]] if os.environ.get(KEY_ENV) else [])]
    if any(not k.strip() for k in all_keys):
        raise ValueError("an API key is empty")
    if hosts:
        allowed = None if "*" in hosts else frozenset(h.lower() for h in hosts)
    else:
        allowed = LOOPBACK_NAMES | {bind} if is_loopback(bind) else None
    return GateConfig(tuple(all_keys), allowed, frozenset(origins or ()), open_health)


def host_name(header: str) -> str:
    """A Host header's name, lowercased, without its port: "[::1]:9000" -> "::1", "Example:80" -> "example"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def key_matches(given: str, keys: tuple[str, ...]) -> bool:
    """Whether `given` is one of `keys`, every key compared in full (no early exit on the first match)."""
    found = False
    for k in keys:
        found |= hmac.compare_digest(given.encode(), k.encode())
    return found


def bearer(headers: Headers) -> str | None:
    """The key of an `Authorization: Bearer KEY` header, else None."""
    scheme, _, given = headers.get("authorization", "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else None


def tenant(cfg: GateConfig, headers: Headers) -> str:
    """The API key a request was let in with ("" where the server asks for none): its prefix-reuse tenant."""
    return (bearer(headers) or "") if cfg.api_keys else ""


def refusal(cfg: GateConfig, method: str, path: str, headers: Headers) -> ApiError | None:
    """Why this request is refused, or None."""
    if cfg.allowed_hosts is not None and host_name(headers.get("host", "")) not in cfg.allowed_hosts:
        return ApiError(403, "the request's Host is not one this server answers to (serve --allowed-host)", None,
                        "host_not_allowed")
    origin = headers.get("origin")
    if origin is not None and origin not in cfg.allowed_origins:
        return ApiError(403, f"requests from the web origin {origin[:100]!r} are not allowed (serve "
                             "--allowed-origin)", None, "origin_not_allowed")
    if cfg.api_keys and not (cfg.open_health and path in OPEN_PATHS):
        given = bearer(headers)
        if given is None or not key_matches(given, cfg.api_keys):
            return ApiError(401, "a valid API key is required: send it as `Authorization: Bearer KEY`", None,
                            "invalid_api_key")
    if method == "POST" and headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        return ApiError(415, "the request body must be JSON, sent with `Content-Type: application/json`", None,
                        "unsupported_media_type")
    return None


class Gate:
    """The ASGI middleware: a refused request gets its error at once; the rest go to the app."""

    def __init__(self, app, cfg: GateConfig) -> None:
        self.app, self.cfg = app, cfg

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refused = refusal(self.cfg, scope["method"], scope["path"], Headers(scope=scope))
            if refused is not None:
                headers = refused.headers() | ({"WWW-Authenticate": "Bearer"} if refused.status == 401 else {})
                await JSONResponse(refused.body(), refused.status, headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)
