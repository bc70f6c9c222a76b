"""`python -m export build|inspect|triton|calibrate`: compile a checkpoint into engines; show what was built; render
the Triton model repository; fit the verifier's confidence head."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spork_trt.errors import UserError

EXAMPLES = """examples:
  python -m export build                                  # the embedded default -> engines/default
  python -m export build --model path/to/model.gguf --out engines/mymodel --verifier-layers 8
  python -m export build --precision int8 --draft self-int4 --force
  python -m export build --draft self-int8 --draft self-int8-static --draft self-fp8   # quantized copies
  python -m export build --backend tensorrt --precision fp8 --out engines/trt   # GPU host with TensorRT
  python -m export inspect engines/default
  python -m export triton                                 # engines/default/triton_repo (cpu profile)
  python -m export triton --profile gpu --out triton_gpu  # ONNX Runtime TensorRT/CUDA providers, KIND_GPU
  python -m export triton --slots 32 --max-context 1024   # 32 requests per batch, smaller KV pool
  python -m export calibrate                              # fit on all of mt_bench, report on all of humaneval
  python -m export calibrate --prompts humaneval --json   # the reverse direction (collected nodes are reused)
  python -m export calibrate --limit 40                   # the first 40 prompts of each set: quicker, noisier
  python -m export calibrate --draft self-int8            # a head for the INT8 self-draft (one head per drafter)
"""


def parser() -> argparse.ArgumentParser:
    from spork_trt.config import SELF_DRAFTS
    from spork_trt.export.build import PRECISIONS, BuildConfig
    from spork_trt.export.tensorrt import PRECISIONS as TRT_PRECISIONS

    p = argparse.ArgumentParser(prog="python -m export", epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile target, verifier and draft engines", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--model", default=None, help="a .gguf file or HF directory (default: SmolLM2-135M-Instruct)")
    b.add_argument("--out", default=str(BuildConfig.out), help="output folder (default: %(default)s)")
    b.add_argument("--precision", default=BuildConfig.precision, choices=sorted(set(PRECISIONS + TRT_PRECISIONS)),
                   help="the target engine's precision: onnx " + ", ".join(PRECISIONS) + "; tensorrt "
                   + ", ".join(TRT_PRECISIONS) + " (default: %(default)s)")
    b.add_argument("--draft", action="append", default=None, metavar="KIND",
                   help=f"quantized self-drafts to build: {', '.join(SELF_DRAFTS)} (repeatable; default: "
                   f"{' and '.join(BuildConfig.drafts)})")
    b.add_argument("--verifier-layers", type=int, default=BuildConfig.verifier_layers,
                   help="layers of the early-layer verifier / early-exit draft (default: %(default)s)")
    b.add_argument("--backend", choices=["onnx", "tensorrt"], default="onnx")
    b.add_argument("--force", action="store_true", help="rebuild even if the artifacts are up to date")
    i = sub.add_parser("inspect", help="print a build's manifest readably")
    i.add_argument("engines", nargs="?", default=str(BuildConfig.out))
    i.add_argument("--json", action="store_true")
    i.add_argument("--verify", action="store_true", help="also check every artifact's sha256")
    t = sub.add_parser("triton", help="render a ready-to-serve Triton model repository from a build",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--engines", default=str(BuildConfig.out), help="a build folder (default: %(default)s)")
    t.add_argument("--out", default=None, help="repository folder (default: ENGINES/triton_repo)")
    t.add_argument("--profile", choices=["cpu", "gpu"], default="cpu",
                   help="cpu: ONNX Runtime CPU; gpu: TensorRT/CUDA execution providers, KIND_GPU (unverified)")
    from spork_trt.triton_repo import RepoConfig

    t.add_argument("--instances", type=int, default=RepoConfig.instances,
                   help="spork model instances, each one engine core over its own KV pool (default: %(default)s)")
    t.add_argument("--slots", type=int, default=RepoConfig.slots,
                   help="requests one instance decodes together (KV pool slots; default: %(default)s)")
    t.add_argument("--max-context", type=int, default=RepoConfig.max_context,
                   help="positions a request may use, prompt + max_tokens (sizes the pool; default: the model's "
                        "context window)")
    t.add_argument("--max-queue", type=int, default=RepoConfig.max_queue,
                   help="requests waiting for a slot per instance; more are answered UNAVAILABLE (default: "
                        "%(default)s)")
    t.add_argument("--unary-instances", type=int, default=RepoConfig.unary_instances,
                   help="spork_unary instances (no engines: they call spork), unary requests served at once "
                        "(default: %(default)s)")
    t.add_argument("--draft", default="ngram", help="the drafter the server uses (default: %(default)s)")
    c = sub.add_parser("calibrate", help="fit the verifier's confidence head on real target verdicts",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    from spork_trt.export.calibrate import CalibrateConfig

    c.add_argument("--engines", default=str(CalibrateConfig.engines), help="a build folder (default: %(default)s)")
    c.add_argument("--prompts", default=CalibrateConfig.prompts,
                   help="set to fit on: mt_bench | humaneval | PATH.jsonl (default: %(default)s)")
    c.add_argument("--heldout", default=None, help="set to report on (default: the other built-in set)")
    c.add_argument("--limit", type=int, default=CalibrateConfig.limit,
                   help="prompts per set (default: all, 80 MT-bench and 164 HumanEval; about 15 minutes on 2 cores "
                        "for the n-gram drafter, collected once and cached)")
    c.add_argument("--max-new-tokens", type=int, default=CalibrateConfig.max_new_tokens)
    c.add_argument("--draft", default=CalibrateConfig.draft,
                   help="the drafter whose trees are scored; the head is saved for it (default: %(default)s)")
    c.add_argument("--tree-depth", type=int, default=None,
                   help="draft depth while collecting (default: the drafter's own; deeper labels more depths)")
    c.add_argument("--plot", default=None, help="reliability diagram PNG (default: ENGINES/calibration/...)")
    c.add_argument("--json", action="store_true", help='print {"per_depth": [...], "heldout": ...}')
    return p


def calibrate(a) -> int:
    from spork_trt.export.calibrate import CalibrateConfig, calibrate, table

    if any(v is not None and v <= 0 for v in (a.limit, a.max_new_tokens, a.tree_depth)):
        raise UserError("--limit, --max-new-tokens and --tree-depth must be positive")
    report = calibrate(CalibrateConfig(Path(a.engines), a.prompts, a.heldout, a.limit, a.max_new_tokens, a.draft,
                                       a.tree_depth, Path(a.plot) if a.plot else None))
    print(json.dumps(report.to_json()) if a.json else table(report))
    return 0


def triton(a) -> int:
    from spork_trt.triton_repo import RepoConfig, render

    repo = render(RepoConfig(Path(a.engines), Path(a.out) if a.out else None, a.profile, a.instances, a.slots,
                             a.draft, a.max_context, a.max_queue, a.unary_instances))
    print(f"rendered {repo} ({a.profile} profile): serve it with `python -m spork_trt serve --repo {repo}`")
    return 0


def inspect(a) -> int:
    from spork_trt.export import manifest as mf

    d = Path(a.engines)
    m = mf.read(d)
    if a.verify:
        mf.verify_artifacts(d, m)
    if a.json:
        print(json.dumps(m, indent=1))
        return 0
    spec = m["model"]
    print(f"{d}: {spec['family']} {spec['n_layers']} layers, hidden {spec['dim']}, heads {spec['n_heads']}/"
          f"{spec['n_kv_heads']} kv, vocab {spec['vocab_size']}, context {spec['max_seq_len']}")
    print(f"source: {m['source']['path']} ({m['source']['kind']}, sha256 {m['source']['sha256'][:12]})")
    print(f"backend: {m['backend']}; drafters: {', '.join(m['drafters'])}")
    for role, e in m["engines"].items():
        size = mf.weights(m, e).get("bytes", 0)
        print(f"  {role:17} {e['path']:24} {e['precision']:12} {e['layers']:3} layers  {size / 1e6:8.1f} MB")
    print("tools: " + ", ".join(f"{k} {v}" for k, v in m["tools"].items()))
    if a.verify:
        print(f"all {len(m['artifacts'])} artifacts match their sha256")
    return 0


def main(argv=None) -> int:
    try:
        a = parser().parse_args(argv)
        if a.command == "inspect":
            return inspect(a)
        if a.command == "triton":
            return triton(a)
        if a.command == "calibrate":
            return calibrate(a)
        from spork_trt.export.build import BuildConfig, build

        drafts = tuple(a.draft) if a.draft else BuildConfig.drafts
        build(BuildConfig(model=a.model, out=Path(a.out), precision=a.precision, drafts=drafts,
                          verifier_layers=a.verifier_layers, backend=a.backend, force=a.force))
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


sys.exit(main())
