"""`python -m spork_trt serve|client|demo`: the Triton side of the command line (cli/main.py builds the parser)."""
from __future__ import annotations

import argparse
import json
import sys

from spork_trt.config import CPU_TORCH_DTYPES, GenerateConfig
from spork_trt.errors import UserError
from spork_trt.serving.openai_api.server import FrontConfig
from spork_trt.serving.watchdog import DEFAULT_BOUND_S

SERVE_EXAMPLES = """examples:
  python -m spork_trt serve                                   # engines/default/triton_repo on 127.0.0.1:8000/8001
  python -m spork_trt serve --repo engines/default/triton_repo --http-port 9000 --grpc-port 9001
  python -m spork_trt serve --host 0.0.0.0                    # listen beyond loopback (you decide who can reach it)
  python -m spork_trt serve --drain-timeout 120               # SIGTERM: in-flight requests get 2 minutes to finish
  python -m spork_trt serve --openai-port 0                   # no OpenAI-compatible API (default: on port 9000)
  python -m spork_trt serve --chat-template generic           # OpenAI tools/tool_choice on a template without tools
  SPORK_API_KEY=$(cat key.txt) python -m spork_trt serve      # the OpenAI API asks for `Authorization: Bearer KEY`
  python -m spork_trt serve --host 0.0.0.0 --api-key "$KEY" --allowed-origin https://chat.example.com
  python -m spork_trt serve --replicas 2                      # two servers behind haproxy on 8000/8001

SIGTERM (or Ctrl-C) drains: readiness turns false at once, new requests are refused, in-flight ones finish within
--drain-timeout; the exit code is 0 when everything finished, 1 otherwise. A second Ctrl-C stops at once. An engine
loop that stops serving for --stall-timeout seconds stops the server: exit code 3. Nothing of the server outlives
this command, however it ends (SIGHUP, SIGKILL included).
"""
CLIENT_EXAMPLES = """examples:
  python -m spork_trt client "What is speculative decoding?" --stream          # gRPC streaming
  python -m spork_trt client "Explain TCP" --protocol http --max-tokens 64      # tritonclient HTTP infer
  python -m spork_trt client "Explain TCP" --protocol generate --stream         # HTTP generate_stream (SSE)
  python -m spork_trt client "Explain TCP" --mode plain --json                  # the baseline, stats as JSON
  python -m spork_trt client "List three fruits" --stop "3." --stream           # ends where "3." starts
"""
DEMO_EXAMPLES = """examples:
  python -m spork_trt demo                      # build engines if missing, serve with Triton, stream one answer
  python -m spork_trt demo "Write a haiku about CPUs" --max-tokens 64
"""


def add_serving_commands(sub) -> None:
    from spork_trt.serving.triton_client import PROTOCOLS
    from spork_trt.serving.triton_repo import RepoConfig

    fmt = argparse.RawDescriptionHelpFormatter
    s = sub.add_parser("serve", help="run Triton Inference Server on a rendered repository", epilog=SERVE_EXAMPLES,
                       formatter_class=fmt, description="Start tritonserver, wait until ready, serve until Ctrl-C.")
    s.add_argument("--repo", default=None, help="model repository (default: ENGINES/triton_repo, rendered if absent)")
    s.add_argument("--engines", default=str(RepoConfig.engines), help="engines folder (default: %(default)s)")
    s.add_argument("--verify", action="store_true", help="check every artifact's sha256 against the build's manifest "
                   "before starting (sizes are always checked, here and by each model instance)")
    s.add_argument("--host", default="127.0.0.1", help="IPv4 address to bind (default: %(default)s, loopback only)")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--openai-port", type=int, default=9000,
                   help="the OpenAI-compatible API (/v1/chat/completions, ...) on --host (default: %(default)s; 0: off)")
    s.add_argument("--openai-model", default=None, metavar="NAME",
                   help="the model name the OpenAI API serves (default: the build's checkpoint name)")
    s.add_argument("--chat-template", default=None, metavar="generic|FILE",
                   help="how the OpenAI API writes `tools` into the prompt: generic (the project's generic tool "
                   "format over the checkpoint's own template, docs/serving.md) or a Jinja chat template file that "
                   "replaces the checkpoint's (default: the checkpoint's own; without tools in it, tools are a 400)")
    s.add_argument("--max-body-bytes", type=int, default=FrontConfig.max_body_bytes, metavar="N",
                   help="the OpenAI API refuses a larger request body while reading it, 413 (default: %(default)s)")
    s.add_argument("--api-key", action="append", metavar="KEY",
                   help="the OpenAI API answers only requests with `Authorization: Bearer KEY` (repeatable; also "
                   "$SPORK_API_KEY, which other local users cannot read from the process list; default: no key)")
    s.add_argument("--health-needs-key", action="store_true",
                   help="with a key, /health asks for it too (default: open, for probes and load balancers)")
    s.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="a Host name the OpenAI API answers to (repeatable; * for any; default: loopback names on a "
                   "loopback --host, any otherwise): a web page cannot rebind its own name to your loopback API")
    s.add_argument("--allowed-origin", action="append", metavar="URL",
                   help="a web origin whose browser requests the OpenAI API accepts, e.g. https://chat.example.com "
                   "(repeatable; default: none: requests carrying an Origin are refused)")
    s.add_argument("--log", default=None, help="server log file (default: next to the repository; the previous "
                   "one is kept as LOG.1)")
    s.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/Ctrl-C, seconds in-flight requests get to finish (default: %(default)s)")
    s.add_argument("--stall-timeout", type=float, default=DEFAULT_BOUND_S, metavar="S",
                   help="an engine loop that stops serving for S seconds (a step that does not end, a dead loop, a "
                   "stopped process) stops the server with exit code 3, for its supervisor to replace "
                   "(default: %(default)s; 0: no watchdog)")
    s.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="N servers (each its own engine core) on loopback ports behind haproxy, which alone holds "
                   "--http-port/--grpc-port and health-checks each one's readiness (default: %(default)s: one "
                   "server, no load balancer)")
    c = sub.add_parser("client", help="query a running server", epilog=CLIENT_EXAMPLES, formatter_class=fmt,
                       description="Send PROMPT to the served ensemble; streamed text goes to stdout, stats to stderr.")
    c.add_argument("prompt")
    c.add_argument("--url", default=None, help="host:port (default: 127.0.0.1 and the protocol's default port)")
    c.add_argument("--protocol", choices=PROTOCOLS, default="grpc",
                   help="grpc / http: tritonclient; generate: Triton's HTTP generate endpoints (default: grpc)")
    c.add_argument("--stream", action="store_true", help="stream text as it is committed (grpc or generate)")
    add_request_flags(c)
    c.add_argument("--retries", type=int, default=3, metavar="N",
                   help="send a request that got no answer yet again, up to N times with backoff, when the server "
                   "refuses it as unavailable or the connection fails (behind --replicas: another replica; "
                   "default: %(default)s)")
    c.add_argument("--json", action="store_true", help="print one JSON object with the text and stats")
    d = sub.add_parser("demo", help="the main job end to end: build, serve, stream one answer, stop",
                       epilog=DEMO_EXAMPLES, formatter_class=fmt)
    d.add_argument("prompt", nargs="?", default="Explain speculative decoding in two sentences.")
    d.add_argument("--engines", default=str(RepoConfig.engines), help="built here if missing (default: %(default)s)")
    add_request_flags(d)


def add_request_flags(p) -> None:
    p.add_argument("--max-tokens", type=int, default=GenerateConfig.max_new_tokens, help="most new tokens (default: "
                   "%(default)s, as every front end)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop-words", "--stop", dest="stop_words", action="append", metavar="STR",
                   help="stop string (repeatable): the answer ends where the first one starts")
    p.add_argument("--mode", choices=["spork", "plain"], default=None, help="spec_mode (default: the server's)")


def interrupt(*_) -> None:
    raise KeyboardInterrupt


def served_target(repo) -> str:
    """The startup line's target: the build's, or its checkpoint on a torch engine where the repository says so."""
    from spork_trt.checkpoint import manifest as mf
    from spork_trt.serving.triton_repo import spork_model

    spork = spork_model(repo)
    m = mf.read(spork.engines)
    device, dtype = spork.params.get("device", ""), spork.params.get("dtype", "")
    if not device:
        return mf.describe_target(m)
    engine = ("the CPU torch engine" if device == "cpu" and dtype in CPU_TORCH_DTYPES
              else f"the device engine on {device}")
    return f"{dtype} target (the build's checkpoint on {engine}), {m['engines']['target']['layers']} layers"


def cmd_serve(a: argparse.Namespace) -> int:
    import os
    import shutil
    import signal
    import tempfile
    from pathlib import Path

    from spork_trt.serving.openai_api.gate import KEY_ENV, gate_config
    from spork_trt.serving.openai_api.server import refuse_port_in_use
    from spork_trt.serving.triton_server import ServerConfig
    from spork_trt.serving.triton_repo import RepoConfig, ensure_rendered
    from spork_trt.serving.watchdog import Watch

    if a.verify and a.repo:
        raise UserError("--verify checks the build of --engines before rendering its repository: drop --repo (or "
                        "check a build with `python -m export inspect DIR --verify`)")
    if a.max_body_bytes <= 0:
        raise UserError(f"--max-body-bytes must be positive, got {a.max_body_bytes}")
    if a.drain_timeout <= 0:
        raise UserError(f"--drain-timeout must be positive, got {a.drain_timeout}")
    if a.stall_timeout < 0:
        raise UserError(f"--stall-timeout must be positive, or 0 for no watchdog; got {a.stall_timeout}")
    if not 0 <= a.openai_port < 65536:
        raise UserError(f"--openai-port must be a port number, or 0 for no OpenAI API; got {a.openai_port}")
    if a.chat_template not in (None, "generic") and not Path(a.chat_template).is_file():
        raise UserError(f"--chat-template {a.chat_template}: no such file (give a Jinja chat template file, or "
                        "generic)")
    try:
        gate = gate_config(a.host, a.api_key, a.allowed_host, a.allowed_origin, not a.health_needs_key)
    except ValueError as e:
        raise UserError(f"--api-key / ${KEY_ENV}: {e}") from None
    if a.openai_port:
        refuse_port_in_use(a.host, a.openai_port)
    repo = Path(a.repo) if a.repo else ensure_rendered(RepoConfig(Path(a.engines)), verify=a.verify)
    cfg = ServerConfig(repo, a.host, a.http_port, a.grpc_port, a.metrics_port, Path(a.log) if a.log else None,
                       drain_timeout_s=a.drain_timeout)
    signal.signal(signal.SIGTERM, interrupt)  # SIGTERM and SIGHUP (terminal closed) drain as Ctrl-C does
    signal.signal(signal.SIGHUP, interrupt)
    # and SIGINT stops it even when started in the background of a script (which starts it with SIGINT ignored)
    signal.signal(signal.SIGINT, interrupt)
    watch = Watch(Path(tempfile.mkdtemp(prefix="spork_trt-beats-")), a.stall_timeout) if a.stall_timeout else None
    os.environ.update(watch.env() if watch else {})  # tritonserver's stubs beat there (watchdog.py)
    try:
        return start_and_serve(a, cfg, repo, gate, watch)
    finally:
        if watch is not None:
            shutil.rmtree(watch.folder, ignore_errors=True)  # this command's own temporary folder


def start_and_serve(a: argparse.Namespace, cfg, repo, gate, watch) -> int:
    """Start Triton (or replicas) and the OpenAI API, say where they listen, serve until stopped."""
    from spork_trt.serving.openai_api.gate import KEY_ENV, is_loopback
    from spork_trt.serving.openai_api.server import OpenAIServer
    from spork_trt.serving.replicas import ReplicaSet
    from spork_trt.serving.triton_server import TritonServer
    from spork_trt.serving.triton_repo import is_rendered

    served = served_target(repo) if is_rendered(repo) else "not a rendered repository"
    server = ReplicaSet(cfg, a.replicas) if a.replicas != 1 else TritonServer(cfg)
    what = f"{a.replicas} tritonservers behind haproxy" if a.replicas != 1 else "tritonserver"
    print(f"starting {what} on {repo}: {served} (log: {cfg.log}) ...", file=sys.stderr, flush=True)
    server.start()
    front = OpenAIServer(FrontConfig(repo, server.grpc_url, a.host, a.openai_port, a.openai_model, a.drain_timeout,
                                     max_body_bytes=a.max_body_bytes, gate=gate, chat_template=a.chat_template))
    try:
        if a.openai_port:
            front.start()
    except BaseException:
        server.stop(timeout_s=10.0)
        raise
    keyed = f"{len(gate.api_keys)} API key(s)" if gate.api_keys else "no API key"
    openai = f"  OpenAI API {front.url} (model {front.model_name}, {keyed})" if a.openai_port else ""
    if a.openai_port and not gate.api_keys and not is_loopback(a.host):
        print(f"warning: the OpenAI API listens on {a.host} with no API key: anyone who can reach the port can use "
              f"it (set --api-key or ${KEY_ENV})", file=sys.stderr, flush=True)
    metrics = (f"{a.host}:{a.metrics_port}" if a.replicas == 1 else "per replica (" + "; ".join(
        f"r{i}: HTTP {s.http_url}, metrics 127.0.0.1:{s.cfg.metrics_port}" for i, s in enumerate(server.servers)) + ")")
    print(f"ready: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {metrics}{openai}  "
          "(models: ensemble, ensemble_unary); Ctrl-C stops", file=sys.stderr, flush=True)
    return until_stopped(a, server, front, watch, cfg.log, what)


def until_stopped(a: argparse.Namespace, server, front, watch, log, what: str) -> int:
    """Serve until Ctrl-C/SIGTERM (a drain: 0 when every request finished, else 1), an engine loop that stops
    beating (watchdog.py: 3), or tritonserver's exit (an error)."""
    from spork_trt.serving.watchdog import wait_serving

    try:
        dead = wait_serving(server.alive, watch, server.replace_stalled)
    except KeyboardInterrupt:
        front.stop()  # first: no new OpenAI requests, its in-flight answers finish while Triton still serves
        print(f"draining: in-flight requests get {a.drain_timeout:g}s to finish (Ctrl-C again stops at once) ...",
              file=sys.stderr, flush=True)
        code = server.stop()
        if code != 0:
            print(f"error: tritonserver did not stop cleanly (exit code {code}): requests may have been cut; see "
                  f"{log}", file=sys.stderr, flush=True)
            return 1
        print("stopped: every request finished", file=sys.stderr, flush=True)
        return 0
    front.stop()
    if dead:
        print(f"error: the engine loop of spork instance(s) {', '.join(dead)} stopped serving (no heartbeat for "
              f"{a.stall_timeout:g}s: a step that does not end, a dead loop or a stopped process; see {log}): "
              "stopping the server so that it is replaced", file=sys.stderr, flush=True)
        server.stop(timeout_s=a.drain_timeout)
        return 3
    code = server.stop()
    raise UserError(f"{what} exited (code {code}); see the logs beside {log}")


def client_config(a: argparse.Namespace, **over):
    from spork_trt.serving.triton_client import ClientConfig
    from spork_trt.io_spec import REQUEST_FIELDS, request_config

    # checked here as the server checks them (the same configs), before anything starts; flags spelled as tensors
    values = {f.tensor.name: tuple(getattr(a, f.tensor.name) or ()) if f.many else getattr(a, f.tensor.name)
              for f in REQUEST_FIELDS if f.tensor}
    request_config({f.field: values[f.tensor.name] for f in REQUEST_FIELDS if f.tensor}, lambda f: f.client_flag)
    fields = {"max_tokens": a.max_tokens, "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k,
              "seed": a.seed, "stop_words": values["stop_words"], "spec_mode": a.mode}
    fields.update(over)
    return ClientConfig(**fields)


def print_reply(reply, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"text": reply.text, "stop_reason": reply.stop_reason, "stats": reply.stats,
                          "time_s": reply.time_s, "ttft_s": reply.ttft_s, "retries": reply.retries}))
        return
    st = reply.stats
    print(flush=True)
    print(f"[triton] {reply.chunks} response(s) in {reply.time_s:.2f}s (first text after {reply.ttft_s:.2f}s), "
          f"{st.get('num_steps', 0):.0f} steps, mean accepted length {st.get('mean_accepted_length', 0):.2f}, "
          f"acceptance {st.get('acceptance_rate', 0):.0%} ({st.get('total_accepted_draft_tokens', 0):.0f}/"
          f"{st.get('total_draft_tokens', 0):.0f} draft tokens), stop: {reply.stop_reason}"
          + (f", sent again {reply.retries} time(s)" if reply.retries else ""), file=sys.stderr)


def cmd_client(a: argparse.Namespace) -> int:
    from spork_trt.serving.triton_client import query

    if a.retries < 0:
        raise UserError(f"--retries must be >= 0, got {a.retries}")
    cfg = client_config(a, url=a.url, protocol=a.protocol, stream=a.stream, retries=a.retries)
    on_text = None if a.json else (lambda t: print(t, end="", flush=True))
    reply = query(a.prompt, cfg, on_text)
    if not a.json and not a.stream:
        print(reply.text, end="")
    print_reply(reply, a.json)
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from pathlib import Path

    from spork_trt.serving.triton_client import query
    from spork_trt.export.build import BuildConfig, build
    from spork_trt.serving.triton_server import ServerConfig, TritonServer, free_port
    from spork_trt.serving.triton_repo import RepoConfig, ensure_rendered

    engines = Path(a.engines)
    if not (engines / "manifest.json").is_file():
        build(BuildConfig(out=engines))  # also renders the Triton repository
    repo = ensure_rendered(RepoConfig(engines))
    cfg = ServerConfig(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    print(f"[demo] starting Triton on {repo}, serving the {served_target(repo)} (log: {cfg.log}) ...",
          file=sys.stderr, flush=True)
    with TritonServer(cfg) as server:
        print(f"[demo] ready on gRPC {server.grpc_url}; streaming the answer to: {a.prompt}", file=sys.stderr,
              flush=True)
        ccfg = client_config(a, url=server.grpc_url, protocol="grpc", stream=True)
        reply = query(a.prompt, ccfg, lambda t: print(t, end="", flush=True))
        print_reply(reply, False)
        print("[demo] stopping Triton", file=sys.stderr, flush=True)
    return 0
