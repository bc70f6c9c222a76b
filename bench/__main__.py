import argparse
import sys

from spork_trt.config import CPU_TORCH_DTYPES, DEVICE_DTYPE, DEVICE_DTYPES
from spork_trt.errors import UserError

EXAMPLES = """examples:
  python -m bench run --prompts mt_bench,humaneval --limit 20 --arms plain spork/ngram spork/self-int8/2x5x10
  python -m bench run --prompts humaneval --max-new-tokens 64 --json --engines engines/default
  python -m bench run --engines engines/default --arms plain spork/store --rounds 8   # 8 interleaved rounds
  python -m bench run --engines engines/default --dtype bf16 --arms plain spork/store   # the bf16 oneDNN target
  python -m bench run --engines engines/default --dtype int4 --arms plain spork/store   # its 4-bit blocks, torch CPU
  python -m bench fidelity engines/int4 engines/int8 --reference engines/default   # quantized targets vs fp32
  python -m bench fidelity --reference engines/default --cpu-torch bf16,int4   # the CPU torch engine vs fp32
  python -m bench roofline engines/default engines/int4        # forward(T) against this machine's bound
  python -m bench roofline engines/default --torch bf16,fp32   # and the torch.compile lever, same run
  python -m bench roofline engines/default --dtype bf16        # and the bf16 oneDNN engine, same run
  python -m bench roofline engines/default --dtype int4        # and the checkpoint's 4-bit blocks on torch, same run
  python -m bench run --engines engines/default --arms plain spork/ngram peer/hf-greedy peer/hf-prompt-lookup
  make bench-peers && python -m bench run --engines engines/default --arms plain spork/ngram peer/llama-cpp \
      peer/llama-cpp-prompt-lookup peer/ort-genai                 # llama.cpp (same GGUF), onnxruntime-genai
  python -m bench plain --limit 4 --max-new-tokens 64     # our torch engine vs transformers generate
  python -m bench serve --limit 8 --concurrency 1,4,16     # through Triton: spork vs plain per concurrency,
                                                          # batching server vs a one-at-a-time one (--max-batch 1)
  python -m bench serve --concurrency 1,4,16 --repeats 3   # each level 3 times, modes alternating: median ratios
  python -m bench chat --limit 16 --concurrency 1,4,16     # two-turn MT-bench over the OpenAI API, prefix reuse on
                                                          # and off: turn-2 TTFT, tokens/s, cached share, lossless
  python -m bench core --concurrency 1,4,8 --rounds 3    # the engine core in process: spork vs plain per
                                                          # concurrency, priced by one fitted cost table (no drift)
  python -m bench core --dtype int4 --concurrency 1,16 --rounds 2   # the same on the int4 CPU torch target
  make bench-peers && python -m bench serve-peers --concurrency 1,4,16   # ours vs llama.cpp's llama-server
  python -m bench soak --clients 32 --duration 600         # valid + bad + cancelled: lost/garbled/wrong, RSS
  python -m bench soak --faults --clients 32 --duration 600   # + OpenAI API, 2 replicas, SIGSTOP and SIGKILL
  python -m bench failover --clients 16 --duration 60      # 2 replicas behind haproxy: one drained, one killed
  python -m bench run --engines engines/default --arms plain spork/ngram spork/ngram/verifier gate/ngram/0.5
  python -m bench gate --engines engines/default --prompts mt_bench,humaneval --taus 0.3,0.5,0.7,0.9
  python -m bench costs --engines engines/default         # target and verifier forward cost by tree nodes
  python -m bench costs --drafts self-int8 self-int4      # + each draft's cost and the speedup ceiling it sets
  python -m bench costs --engines engines/head --drafts eagle   # one step of the learned draft head
  python -m bench costs --nodes 1 --batch 4,16,32         # + batched forwards of B sequences (continuous batching)
  python -m bench agreement --engines engines/quant --prompts mt_bench,humaneval --limit 10   # quantized vs fp32
  python -m bench agreement --head results/draft_head --limit 10   # a draft head, teacher-forced on unseen answers
  python -m bench replay --run results/run --shapes default,8x8x64 --costs 1:2.2,16:3.0,64:3.1,256:3.3   # estimates:
                                                          # n-gram and store replayed on the run's plain answers
  python -m bench replay --run results/run --drafts store --store-fractions 0.25,0.5,1   # smaller stores
  python -m bench gpu --prompts mt_bench --limit 16 --batch 32 --out $OUT   # on a GPU host (bench/gpu_check.sh)
  python -m bench run --prompts json_extract --response-format json_schema --arms plain spork/ngram   # constrained
  python -m bench report --run results/run --serve results/serve --gate results/gate --readme docs/benchmarks.md
"""
DEFAULT_ARMS = ["plain", "spork/ngram", "spork/self-int8", "spork/self-int4", "spork/early-exit:8"]


def token_specs(text: str) -> list[str]:
    """--batch-tokens: comma-separated T (new tokens each) or A:T (A for the first sequence, T for the others)."""
    specs = [x for x in text.split(",") if x]
    if not specs or not all(all(p.isdigit() and int(p) > 0 for p in x.split(":")) and x.count(":") <= 1
                            for x in specs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected entries T or A:T (positive integers), e.g. 1,4,16:1")
    return specs


def add_common(p) -> None:
    p.add_argument("--prompts", default="mt_bench",
                   help="mt_bench | humaneval | long_docs | rag_mix | json_extract | PATH.jsonl (comma list for run)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--engines", default=None, help="ONNX Runtime engines folder (default: the torch engine)")


def add_dtype(p) -> None:
    p.add_argument("--dtype", choices=("fp32",) + CPU_TORCH_DTYPES, default="fp32",
                   help="bf16, int4: the spork and plain arms run the --engines build's checkpoint (or --model) on "
                        "the CPU torch engine (engines/cpu/engine.py: bf16 on oneDNN's kernels; int4 on the file's "
                        "own blocks), not its ONNX target or the fp32 reference (default: %(default)s)")


def add_response_format(p) -> None:
    p.add_argument("--response-format", default=None, metavar="KIND[:SOURCE]",
                   help="constrained decoding for plain and spork arms: json, json_schema (each prompt's own schema: "
                        "--prompts json_extract), json_schema:FILE, regex:RE or ebnf:FILE, as `generate --grammar`")


def add_rounds(p) -> None:
    p.add_argument("--rounds", type=int, default=4, help="run each prompt set in R interleaved rounds, every arm on "
                   "one round's prompts before the next (paired in time against machine drift; 1: each arm on the "
                   "whole set in turn) (default: %(default)s)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="offline arms side by side (plain always included)", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(r)
    r.add_argument("--arms", nargs="+", default=DEFAULT_ARMS,
                   help="plain | spork/DRAFT[/KxMxN][/fixed][/verifier|/noverifier] | gate/DRAFT/TAU | "
                        "peer/hf-greedy | peer/hf-prompt-lookup | peer/llama-cpp | peer/llama-cpp-prompt-lookup | "
                        "peer/ort-genai (llama.cpp and onnxruntime-genai: `make bench-peers` installs them)")
    r.add_argument("--out", default="results/run", help="folder for JSONL records and the summary")
    add_dtype(r)
    add_response_format(r)
    add_rounds(r)
    r.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    gt = sub.add_parser("gate", help="lossy gate mode: speedup and agreement with plain as a function of tau",
                        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(gt)
    gt.set_defaults(engines="engines/default", limit=20, dtype="fp32")
    gt.add_argument("--taus", default="0.3,0.5,0.7,0.9", help="comma list of thresholds (default: %(default)s)")
    gt.add_argument("--draft", default="ngram", help="the drafter (default: %(default)s)")
    gt.add_argument("--out", default="results/gate")
    gt.add_argument("--json", action="store_true")
    add_rounds(gt)
    rp = sub.add_parser("report", help="markdown tables + PNG plots from result folders (and the README block)",
                        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    rp.add_argument("--run", nargs="*", default=[], help="`bench run --out` folders (summary.json + JSONL)")
    rp.add_argument("--serve", default=None, help="a `bench serve --out` folder")
    rp.add_argument("--gate", default=None, help="a `bench gate --out` folder")
    rp.add_argument("--out", default="docs/bench", help="where report.md and the PNGs go (default: %(default)s)")
    rp.add_argument("--readme", default=None, help="rewrite the generated benchmark block of this file "
                    "(docs/benchmarks.md)")
    co = sub.add_parser("costs", help="target and verifier forward cost by tree nodes (the scheduler's cost model)",
                        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    co.add_argument("--engines", default="engines/default")
    co.add_argument("--nodes", default="1,2,4,8,13,16,32,64", help="tree sizes (default: %(default)s)")
    co.add_argument("--context", type=int, default=200, help="committed tokens before the tree")
    co.add_argument("--repeats", type=int, default=15)
    co.add_argument("--prefill-chunk", type=int, default=128,
                    help="prompt tokens of the prefill forward timed with logits at every row and at the last only "
                         "(default: %(default)s, the engine core's chunk)")
    co.add_argument("--batch", default="", metavar="B,B,...",
                    help="also time one batched forward (the engine core's) of B sequences x --batch-tokens new "
                         "tokens each, contexts --context - 16 b, e.g. 4,16,32 (default: none)")
    co.add_argument("--batch-tokens", default="1,4", metavar="T,T,...", type=token_specs,
                    help="new tokens per sequence of the batched forwards; A:T gives the first sequence A and the "
                         "others T, e.g. 1,4,16:1 (default: %(default)s)")
    co.add_argument("--drafts", nargs="*", default=[], metavar="DRAFT",
                    help="model drafts to time too (self-int8, self-int4, early-exit:N, eagle, ...), each with the "
                         "ceiling its cost puts on speculation")
    co.add_argument("--json", action="store_true")
    ag = sub.add_parser("agreement", help="top-1 agreement with the fp32 target of each quantized engine of a build",
                        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(ag)
    ag.set_defaults(engines="engines/default", limit=10, prompts="mt_bench,humaneval")
    ag.add_argument("--out", default="results/agreement")
    ag.add_argument("--head", default=None, help="also a trained draft head (an `export train-draft` folder or its "
                    "head.safetensors): top-1 agreement by depth on the target's answers, text it never trained on")
    ag.add_argument("--json", action="store_true")
    fi = sub.add_parser("fidelity", help="each build's target against the fp32 reference, teacher-forced on held-out "
                        "text: top-1 agreement, KL, perplexity", epilog=EXAMPLES,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    fi.add_argument("builds", nargs="*", help="build folders whose targets to measure (same checkpoint)")
    fi.add_argument("--reference", default="engines/default", help="a build with an fp32 target (default: "
                    "%(default)s)")
    fi.add_argument("--chunks", type=int, default=16, help="held-out text chunks (default: %(default)s)")
    fi.add_argument("--tokens", type=int, default=512, help="tokens per chunk (default: %(default)s)")
    fi.add_argument("--torch", default="", metavar="DTYPES", help="also the reference model in these dtypes "
                    "(bf16,fp32): the torch lever's fidelity (bench roofline --torch)")
    fi.add_argument("--cpu-torch", default="", metavar="DTYPES", help="also the --reference build's checkpoint on "
                    "the CPU torch engine in these precisions (bf16,int4: generate/serve --dtype)")
    fi.add_argument("--out", default="results/fidelity")
    fi.add_argument("--json", action="store_true")
    ro = sub.add_parser("roofline", help="this machine's bandwidth and matmul peak, each build's target forward(T) "
                        "against its bound", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    ro.add_argument("builds", nargs="+", help="build folders whose targets to time")
    ro.add_argument("--tokens", default="1,16,64", help="new tokens of the one-sequence forwards (default: "
                    "%(default)s)")
    ro.add_argument("--batch", type=int, default=16, help="sequences of the one-token batched forward (default: "
                    "%(default)s)")
    ro.add_argument("--repeats", type=int, default=7)
    ro.add_argument("--torch", default="", metavar="DTYPES", help="also the lever of the reference model under "
                    "torch.compile in these dtypes (bf16,fp32), at the same shapes: not an engine")
    ro.add_argument("--torch-eager", action="store_true", help="run --torch's model eagerly (no compile)")
    ro.add_argument("--dtype", choices=("fp32",) + CPU_TORCH_DTYPES, default="fp32",
                    help="bf16, int4: also each build's checkpoint on the CPU torch engine in that precision "
                         "(default: %(default)s)")
    ro.add_argument("--out", default="results/roofline")
    ro.add_argument("--json", action="store_true")
    rl = sub.add_parser("replay", help="estimates: the n-gram and store drafters replayed over a run's recorded "
                        "plain answers with the scheduler and a cost curve (shapes, store sizes, a GPU's costs)",
                        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    rl.add_argument("--run", default="results/run", help="a `bench run --out` folder with plain records")
    rl.add_argument("--prompts", default="mt_bench,humaneval", help="prompt sets of that run (default: %(default)s)")
    rl.add_argument("--engines", default="engines/default", help="the tokenizer and the store (default: %(default)s)")
    rl.add_argument("--drafts", nargs="+", default=["ngram", "store"], help="ngram and/or store (default: both)")
    rl.add_argument("--shapes", default="default", help="comma list of KxMxN tree shapes, or default (the drafter's "
                    "measured one) (default: %(default)s)")
    rl.add_argument("--costs", default=None, metavar="N:S,...", help="target forward cost by tokens, e.g. a GPU's "
                    "1:2.2,16:3.0,64:3.1,256:3.3 (default: the scheduler's prior, 8%% more per extra token)")
    rl.add_argument("--store-fractions", default="1", help="comma list: the store over this random share of the "
                    "corpus' sequences (default: %(default)s)")
    rl.add_argument("--json", action="store_true")
    w = sub.add_parser("worker", help="(internal) one arm on one prompt set")
    add_common(w)
    w.add_argument("--arm", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--shard", default="0/1", help="K/R: the prompts whose index is K modulo R (default: all)")
    add_dtype(w)
    add_response_format(w)
    pl = sub.add_parser("plain", help="plain greedy tokens/s: ours vs transformers, and the bandwidth bound",
                        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(pl)
    pl.set_defaults(limit=8)
    pl.add_argument("--skip-transformers", action="store_true")
    pl.add_argument("--json", action="store_true")
    sv = sub.add_parser("serve", help="through Triton: concurrency sweep, spork vs plain, overhead vs local",
                        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(sv)
    sv.set_defaults(limit=16, engines="engines/default")
    sv.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="comma list of client counts")
    sv.add_argument("--slots", type=int, default=32, help="KV slots of the batching server (default: %(default)s)")
    sv.add_argument("--max-batch", type=int, default=1,
                    help="slots of the reference server measured in the same run (default: %(default)s, one request "
                         "at a time; 0 skips it)")
    sv.add_argument("--reference-concurrency", default="1,16",
                    help="client counts for the reference server (default: %(default)s)")
    sv.add_argument("--modes", default="spork,plain", help="spec_mode values to compare")
    sv.add_argument("--repeats", type=int, default=1,
                    help="measure each level this many times, the modes' order alternating, and report the median "
                         "paired ratio (default: %(default)s)")
    cr = sub.add_parser("core", help="the engine core in process: spork vs plain per concurrency, wall and priced "
                        "by one fitted cost table", epilog=EXAMPLES,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(cr)
    cr.set_defaults(limit=16, engines="engines/default")
    cr.add_argument("--concurrency", default="1,4,8,16", help="comma list of requests in flight (default: %(default)s)")
    cr.add_argument("--rounds", type=int, default=3,
                    help="runs of each mode per level, the modes' order alternating (default: %(default)s)")
    cr.add_argument("--modes", default="spork,plain", help="two modes, one of them plain (default: %(default)s)")
    cr.add_argument("--draft", default=None, help="the spork drafter (default: the build's default)")
    add_dtype(cr)
    cr.add_argument("--out", default="results/core")
    ch = sub.add_parser("chat", help="two-turn MT-bench through the OpenAI API, prefix reuse on and off, spork and "
                        "plain: TTFT per turn, tokens/s, cached share, same text", epilog=EXAMPLES,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(ch)
    ch.set_defaults(limit=16, engines="engines/default")
    ch.add_argument("--concurrency", default="1,4,16", help="comma list of client counts (default: %(default)s)")
    ch.add_argument("--slots", type=int, default=32, help="KV slots of the server (default: %(default)s)")
    ch.add_argument("--repeats", type=int, default=1,
                    help="measure reuse on and off this many times, their order alternating (default: %(default)s)")
    ch.add_argument("--modes", default="spork,plain",
                    help="spec_mode values, each on its own server (default: %(default)s)")
    ch.add_argument("--out", default="results/chat")
    ch.add_argument("--json", action="store_true")
    sp = sub.add_parser("serve-peers", help="our server against llama.cpp's llama-server, the same OpenAI-API load: "
                        "tokens/s and TTFT per client count", epilog=EXAMPLES,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(sp)
    sp.set_defaults(limit=16, engines="engines/default")
    sp.add_argument("--concurrency", default="1,4,16", help="comma list of client counts (default: %(default)s)")
    sp.add_argument("--slots", type=int, default=16,
                    help="requests each server decodes at once (ours: KV slots; llama-server: --parallel; default: "
                         "%(default)s)")
    sp.add_argument("--llama-type", default=None, help="q8_0 | q4_0: llama.cpp's requantization of the GGUF "
                    "(default: the GGUF as built)")
    sp.add_argument("--llama-server", default=None,
                    help="the llama-server binary (default: .cache/llama-server/bin/llama-server, built by `make "
                         "bench-peers`)")
    sp.add_argument("--out", default="results/serve_peers")
    sp.add_argument("--json", action="store_true")
    sk = sub.add_parser("soak", help="through Triton: N clients for a fixed time, valid + bad + cancelled requests",
                        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(sk)
    sk.set_defaults(limit=8, engines="engines/default")
    sk.add_argument("--clients", type=int, default=32)
    sk.add_argument("--duration", type=float, default=600.0, help="seconds (default: %(default)s)")
    sk.add_argument("--slots", type=int, default=16, help="KV slots of the server (default: %(default)s)")
    sk.add_argument("--bad", type=float, default=0.15, help="share of bad requests (default: %(default)s)")
    sk.add_argument("--cancel", type=float, default=0.15, help="share of cancelled streams (default: %(default)s)")
    sk.add_argument("--deadline", type=float, default=0.1,
                    help="share of long requests with a deadline of a fraction of a second (default: %(default)s)")
    sk.add_argument("--sampled", type=float, default=0.2,
                    help="share of seeded sampling requests (plain mode; the rest greedy) (default: %(default)s)")
    sk.add_argument("--max-queue", type=int, default=None,
                    help="the server's queue beyond its slots (default: the clients, at least 64; small: the queue "
                    "fills and requests are refused as unavailable)")
    sk.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples")
    sk.add_argument("--faults", action="store_true",
                    help="against `serve --replicas 2` with the OpenAI API (a third of the clients, bad bodies of "
                    "every kind included): r0's engine stopped with SIGSTOP at 25%% of the run, r1 killed at 55%% "
                    "(bench/soak_faults.py)")
    sk.add_argument("--pause", type=float, default=30.0,
                    help="with --faults: seconds r0's engine stays stopped (default: %(default)s)")
    sk.add_argument("--stall-timeout", type=float, default=10.0,
                    help="with --faults: serve's watchdog bound (default: %(default)s)")
    sk.add_argument("--out", default="results/soak")
    sk.add_argument("--json", action="store_true")
    fo = sub.add_parser("failover", help="two replicas behind haproxy under N clients: one drained (SIGTERM), then "
                        "one killed (SIGKILL) mid-run; ok / wrong / cut / lost", epilog=EXAMPLES,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(fo)
    fo.set_defaults(limit=4, engines="engines/default", max_new_tokens=48)
    fo.add_argument("--clients", type=int, default=16)
    fo.add_argument("--duration", type=float, default=60.0, help="seconds per phase (default: %(default)s)")
    fo.add_argument("--slots", type=int, default=16, help="KV slots of each replica (default: %(default)s)")
    fo.add_argument("--drain-timeout", type=float, default=60.0,
                    help="seconds the drained replica's in-flight requests get (default: %(default)s)")
    fo.add_argument("--out", default="results/failover")
    fo.add_argument("--json", action="store_true")
    add_dtype(sv)
    sv.add_argument("--out", default="results/serve")
    sv.add_argument("--json", action="store_true")
    gp = sub.add_parser("gpu", help="the GPU engine's check: parity, plain vs HF generate, spork at batch 1, "
                        "batched (bench/gpu_check.sh runs it on a GPU)", epilog=EXAMPLES,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(gp)
    gp.set_defaults(limit=16)
    gp.add_argument("--device", default="cuda", help="cuda (default) or cpu (a self-check with small --limit)")
    gp.add_argument("--dtype", choices=DEVICE_DTYPES, default=DEVICE_DTYPE)
    gp.add_argument("--batch", type=int, default=32, help="engine-core slots for the batched run (default: 32)")
    gp.add_argument("--profile", action="store_true", help="instead: the forward's cost by tokens (engine call vs "
                    "graph replay), plain and the store arm, and torch.profiler tables of the store arm")
    gp.add_argument("--out", default="results/gpu")
    args = p.parse_args(argv)
    try:
        if args.command == "gpu":
            from . import gpu

            return gpu.main(args)
        if args.command == "run":
            from . import run

            return run.main(args)
        if args.command == "serve":
            from . import serve

            return serve.main(args)
        if args.command == "core":
            from . import core

            return core.main(args)
        if args.command == "chat":
            from . import chat

            return chat.main(args)
        if args.command == "serve-peers":
            from . import serve_peers

            return serve_peers.main(args)
        if args.command == "soak":
            from . import soak

            return soak.main(args)
        if args.command == "failover":
            from . import failover

            return failover.main(args)
        if args.command == "replay":
            from . import replay

            return replay.main(args)
        if args.command == "costs":
            from . import costs

            return costs.main(args)
        if args.command == "report":
            from . import report

            return report.main(args)
        if args.command == "roofline":
            from . import roofline

            return roofline.main(args)
        if args.command == "fidelity":
            from . import fidelity

            return fidelity.main(args)
        if args.command == "agreement":
            from . import agreement

            return agreement.main(args)
        if args.command == "gate":
            from . import gate

            return gate.main(args)
        if args.command == "worker":
            from . import worker

            return worker.main(args)
        from . import plain

        return plain.main(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
