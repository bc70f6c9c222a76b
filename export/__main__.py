"""`python -m export build|inspect|triton|calibrate|self-data|pack|train-draft|convert-head`: compile a checkpoint
into engines; show what was built; render the Triton model repository; fit the verifier's confidence head; generate
the target's own text (the learned drafts' training data); pack it into the corpus that ships for its target; train
the draft head on it; convert a published EAGLE-3 head."""
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
  python -m export triton                                 # engines/default/triton_repo (cpu profile, default target)
  python -m export triton --device onnx                   # serve the build's ONNX target (not the int4 CPU engine)
  python -m export triton --profile gpu --out triton_gpu  # the device engine on CUDA (fp32, CUDA graphs), KIND_GPU
  python -m export triton --profile gpu-onnx --out triton_ort  # ONNX Runtime TensorRT/CUDA providers, KIND_GPU
  python -m export triton --slots 32 --max-context 1024   # 32 requests per batch, smaller KV pool
  python -m export k8s --image registry.example/spork:0.1 --namespace llm   # kustomize manifests -> deploy/
  python -m export calibrate                              # fit on all of mt_bench, report on all of humaneval
  python -m export calibrate --prompts humaneval --json   # the reverse direction (collected nodes are reused)
  python -m export calibrate --limit 40                   # the first 40 prompts of each set: quicker, noisier
  python -m export calibrate --draft self-int8            # a head for the INT8 self-draft (one head per drafter)
  python -m export self-data --magpie 1024 --stdlib 512   # the target's own text -> results/selfdata (resumable)
  python -m export self-data --magpie 1300 --stdlib 1400 --openers 1300   # + prompts begun "Write", "Explain", ...
  python -m export self-data --device cuda --slots 128 --magpie 4000 --openers 4000 --stdlib 1400   # on a GPU
  python -m export pack                                   # results/selfdata -> the shipped corpus of this target
  python -m export build --store results/selfdata         # a datastore from any self-data run
  python -m export build --head results/draft_head        # add a trained draft head (--draft eagle)
  python -m export train-draft --epochs 4 --steps 3       # the draft head on results/selfdata (--resume continues)
  python -m export train-draft --data shipped --epochs 3  # on the corpus shipped for the default model
  python -m export train-draft --device cuda --taps 2,15,29 --vocab 8192
  python -m export convert-head path/to/EAGLE3-checkpoint --out heads/eagle3 --model path/to/target.gguf
"""


def parser() -> argparse.ArgumentParser:
    from spork_trt.draft_kinds import SELF_DRAFTS
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
    b.add_argument("--attention", choices=["gqa", "plain"], default=BuildConfig.attention,
                   help="the ONNX graphs' attention: gqa = ONNX Runtime's GroupQueryAttention op (CPU: fastest, "
                        "appends KV rows in place); plain = standard ops only (ONNX Runtime's GPU providers; "
                        "--backend tensorrt always uses it) (default: %(default)s)")
    b.add_argument("--force", action="store_true", help="rebuild even if the artifacts are up to date; build into a "
                   "non-empty folder that is not a build (nothing in it is deleted)")
    b.add_argument("--store", default=BuildConfig.store, metavar="auto|none|DIR",
                   help="the datastore's text (--draft store): auto = the corpus shipped for this checkpoint, if any; "
                        "a folder from `export pack` or `export self-data` (default: %(default)s)")
    b.add_argument("--head", default=BuildConfig.head, metavar="auto|none|DIR",
                   help="the learned draft head (--draft eagle): auto = the head shipped for this checkpoint, if any; "
                        "a `python -m export train-draft` folder (default: %(default)s)")
    i = sub.add_parser("inspect", help="print a build's manifest readably")
    i.add_argument("engines", nargs="?", default=str(BuildConfig.out))
    i.add_argument("--json", action="store_true")
    i.add_argument("--verify", action="store_true", help="also check every artifact's sha256")
    t = sub.add_parser("triton", help="render a ready-to-serve Triton model repository from a build",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--engines", default=str(BuildConfig.out), help="a build folder (default: %(default)s)")
    t.add_argument("--out", default=None, help="repository folder (default: ENGINES/triton_repo)")
    from spork_trt.config import AUTO_DTYPE, DEVICE_DTYPES, TARGET_DTYPES
    from spork_trt.serving.triton_repo import PROFILES, RepoConfig

    t.add_argument("--profile", choices=PROFILES, default="cpu",
                   help="cpu: ONNX Runtime CPU; gpu: the device engine on CUDA (CUDA graphs, KV pool on the GPU), "
                        "KIND_GPU; gpu-onnx: the build's graphs on ONNX Runtime's TensorRT/CUDA execution providers, "
                        "KIND_GPU (both gpu profiles unverified: never run on a GPU)")
    t.add_argument("--device", choices=["cuda", "cpu", "onnx"], default=None,
                   help="where the spork model's target runs: cuda or cpu = the build's checkpoint on a torch engine "
                        "there (cpu with --dtype bf16: oneDNN's bf16 kernels; --dtype int4: the checkpoint's own "
                        "4-bit blocks; cpu in fp32: the device engine's code eagerly, for checks), onnx = the build's "
                        "ONNX Runtime engines (default: cuda for --profile gpu; else the build's default target on "
                        "this host: cpu int4 where the CPU has oneDNN's bf16 kernels and the checkpoint 4-bit blocks, "
                        "else onnx)")
    t.add_argument("--dtype", choices=(AUTO_DTYPE, *TARGET_DTYPES), default=RepoConfig.dtype,
                   help="that torch engine's precision (default: %(default)s: with no --device, the build's default "
                        "target, see --device; with one, fp32)")

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
    t.add_argument("--request-timeout", type=float, default=RepoConfig.request_timeout_s, metavar="S",
                   help="a request's deadline in seconds: it ends with stop_reason timeout and what it generated; "
                        "clients may ask less with the timeout_s input (default: %(default)s)")
    t.add_argument("--no-prefix-reuse", action="store_true",
                   help="prefill every prompt whole (default: a prompt that starts with a finished request's tokens, "
                        "a conversation's next turn, reuses their KV rows)")
    t.add_argument("--unary-instances", type=int, default=RepoConfig.unary_instances,
                   help="instances of each unary model, spork_unary and ensemble_unary (no engines: they call "
                        "spork), each serving a batch of unary requests at once (default: %(default)s)")
    t.add_argument("--draft", default=RepoConfig.draft,
                   help="the drafter the server uses (default: %(default)s: store when the engines have a datastore, "
                        "else ngram)")
    add_k8s_command(sub)
    c = sub.add_parser("calibrate", help="fit the verifier's confidence head on real target verdicts",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    from spork_trt.learn.calibrate import CalibrateConfig

    c.add_argument("--engines", default=str(CalibrateConfig.engines), help="a build folder (default: %(default)s)")
    c.add_argument("--prompts", default=CalibrateConfig.prompts,
                   help="set to fit on: mt_bench | humaneval | PATH.jsonl (default: %(default)s)")
    c.add_argument("--heldout", default=None, help="set to report on (default: the other built-in set)")
    c.add_argument("--limit", type=int, default=CalibrateConfig.limit,
                   help="prompts per set (default: all, 80 MT-bench and 164 HumanEval; about 15 minutes on 2 cores "
                        "for the n-gram drafter, collected once and cached)")
    c.add_argument("--max-new-tokens", type=int, default=CalibrateConfig.max_new_tokens)
    c.add_argument("--draft", default=CalibrateConfig.draft,
                   help="the drafter whose trees are scored; the head is saved for it (default: %(default)s, the "
                        "drafter generate uses by default: store when the engines have a datastore, else ngram)")
    c.add_argument("--tree-depth", type=int, default=None,
                   help="draft depth while collecting (default: the drafter's own; deeper labels more depths)")
    c.add_argument("--plot", default=None, help="reliability diagram PNG (default: ENGINES/calibration/...)")
    c.add_argument("--json", action="store_true", help='print {"per_depth": [...], "heldout": ...}')
    from spork_trt.learn.selfdata import SelfDataConfig as D

    s = sub.add_parser("self-data", help="the target's own answers to prompts it writes itself and to standard-"
                       "library functions: training data of the learned drafts (resumable)", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--engines", default=str(D.engines), help="a build folder (default: %(default)s)")
    s.add_argument("--out", default=str(D.out), help="data folder; a rerun resumes it (default: %(default)s)")
    s.add_argument("--magpie", type=int, default=D.magpie,
                   help="prompts the target writes from its chat template's user-turn prefix (default: %(default)s)")
    s.add_argument("--stdlib", type=int, default=D.stdlib,
                   help="function-completion prompts from the Python standard library (default: %(default)s)")
    s.add_argument("--openers", type=int, default=D.openers,
                   help="prompts the target writes from that prefix begun with an instruction verb (Write, Explain, "
                   "Solve, ...: other kinds of task than bare Magpie's) (default: %(default)s)")
    s.add_argument("--max-new-tokens", type=int, default=D.max_new_tokens,
                   help="answer length (default: %(default)s)")
    s.add_argument("--slots", type=int, default=D.slots, help="requests decoded together (default: %(default)s)")
    s.add_argument("--model", default=None, help="write the data with this checkpoint on torch instead of --engines "
                   "(default with --device cuda: SmolLM2-135M-Instruct)")
    s.add_argument("--device", choices=["cpu", "cuda"], default=D.device,
                   help="cuda: the device engine (CUDA graphs; use many --slots) (default: %(default)s)")
    s.add_argument("--dtype", choices=DEVICE_DTYPES, default=D.dtype,
                   help="the device engine's precision with --device cuda (default: %(default)s)")
    s.add_argument("--seed", type=int, default=D.seed, help="Magpie sampling and stdlib choice (default: %(default)s)")
    k = sub.add_parser("pack", help="a self-data run -> the corpus that ships in the package for its target "
                       "(spork_trt/artifacts/NAME)", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    k.add_argument("--data", default=str(D.out), help="a finished self-data folder (default: %(default)s)")
    k.add_argument("--out", default=None, help="default: spork_trt/artifacts/<the engines' model name>")
    k.add_argument("--engines", default=str(D.engines), help="the build the data came from (default: %(default)s)")
    from spork_trt.learn.train_draft import TrainConfig as T

    r = sub.add_parser("train-draft", help="train the draft head (one decoder layer over the target's hidden "
                       "states) on a self-data run; resumable", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--data", default=str(T.data), help="a self-data folder, a packed one (corpus.npz), or "
                   "\"shipped\": the corpus shipped for the target (default: %(default)s)")
    r.add_argument("--out", default=str(T.out), help="head, checkpoints and cached features (default: %(default)s)")
    r.add_argument("--model", default=None, help="the target checkpoint (default: SmolLM2-135M-Instruct)")
    r.add_argument("--taps", default="", help="comma-separated target layers whose outputs are the features, e.g. "
                   "2,15,29 (EAGLE-3 style fusion; default: the last layer)")
    r.add_argument("--vocab", type=int, default=T.vocab, help="draft vocabulary size (default: %(default)s)")
    r.add_argument("--steps", type=int, default=T.steps,
                   help="training-time test: head steps unrolled on its own outputs (default: %(default)s)")
    r.add_argument("--epochs", type=int, default=T.epochs, help="(default: %(default)s)")
    r.add_argument("--lr", type=float, default=T.lr, help="(default: %(default)s)")
    r.add_argument("--batch", type=int, default=T.batch, help="sequences per optimizer step (default: %(default)s)")
    r.add_argument("--limit", type=int, default=None, help="train on the first N sequences only (data-size sweep)")
    r.add_argument("--device", choices=["cpu", "cuda"], default=T.device)
    r.add_argument("--seed", type=int, default=T.seed)
    r.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    r.add_argument("--loss", choices=["auto", "soft", "hard"], default=T.loss,
                   help="soft: match the target's whole next-token distribution over the draft vocabulary (needs the "
                   "last layer tapped last); hard: its top-1 token only; auto: soft where the taps allow "
                   "(default: %(default)s)")
    r.add_argument("--no-feature-norm", action="store_true",
                   help="feed the target's raw residual stream to the head's fc (heads before 2026-12-02)")
    v = sub.add_parser("convert-head", help="convert a published EAGLE-3 head (config.json + safetensors, Llama "
                       "target) into this project's format for `export build --head`", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("src", help="the EAGLE-3 checkpoint folder")
    v.add_argument("--out", required=True, help="folder for head.safetensors")
    v.add_argument("--model", default=None, help="its target checkpoint, for the default taps (default: "
                   "SmolLM2-135M-Instruct)")
    v.add_argument("--taps", default="", help="the target layers whose outputs its fc fuses (default: EAGLE-3's: "
                   "2, L/2 and L-3 of the target's L layers)")
    return p


def parse_taps(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise UserError(f"--taps {text!r}: comma-separated layer numbers, e.g. 2,15,29") from None


def convert_head(a) -> int:
    from spork_trt.learn.convert_head import convert, default_taps

    taps = parse_taps(a.taps)
    if not taps:
        from spork_trt.checkpoint.weights import load_checkpoint

        taps = default_taps(load_checkpoint(a.model).cfg.n_layers)
    convert(Path(a.src), Path(a.out), taps)
    return 0


def train_draft(a) -> int:
    from spork_trt.learn.train_draft import TrainConfig, train_draft

    meta = train_draft(TrainConfig(Path(a.data), Path(a.out), a.model, parse_taps(a.taps), a.vocab, a.steps,
                                   a.epochs, a.lr, a.batch, limit=a.limit, device=a.device, seed=a.seed,
                                   resume=a.resume, feature_norm=not a.no_feature_norm, loss=a.loss))
    print(json.dumps({k: meta[k] for k in ("epoch", "losses", "evals", "train_tokens", "vocab_coverage")}, indent=1))
    return 0


def pack(a) -> int:
    from spork_trt.checkpoint import manifest as mf
    from spork_trt.export.artifacts import ARTIFACTS, pack

    out = Path(a.out) if a.out else ARTIFACTS / Path(mf.read(Path(a.engines))["source"]["path"]).stem.lower()
    pack(Path(a.data), out)
    return 0


def self_data(a) -> int:
    from spork_trt.learn.selfdata import SelfDataConfig, self_data

    recipe = self_data(SelfDataConfig(engines=Path(a.engines), out=Path(a.out), magpie=a.magpie, stdlib=a.stdlib,
                                      openers=a.openers, max_new_tokens=a.max_new_tokens, slots=a.slots,
                                      seed=a.seed, model=a.model, device=a.device, dtype=a.dtype))
    print(json.dumps(recipe, indent=1))
    return 0


def calibrate(a) -> int:
    from spork_trt.learn.calibrate import CalibrateConfig, calibrate, table

    if any(v is not None and v <= 0 for v in (a.limit, a.max_new_tokens, a.tree_depth)):
        raise UserError("--limit, --max-new-tokens and --tree-depth must be positive")
    report = calibrate(CalibrateConfig(Path(a.engines), a.prompts, a.heldout, a.limit, a.max_new_tokens, a.draft,
                                       a.tree_depth, Path(a.plot) if a.plot else None))
    print(json.dumps(report.to_json()) if a.json else table(report))
    return 0


def triton(a) -> int:
    from spork_trt.serving.triton_repo import RepoConfig, render

    device = "" if a.device == "onnx" else a.device
    repo = render(RepoConfig(Path(a.engines), Path(a.out) if a.out else None, a.profile, a.instances, a.slots,
                             a.draft, a.max_context, a.max_queue, a.unary_instances, device, a.dtype,
                             not a.no_prefix_reuse, a.request_timeout))
    print(f"rendered {repo} ({a.profile} profile): serve it with `python -m spork_trt serve --repo {repo}`")
    return 0


def inspect(a) -> int:
    from spork_trt.checkpoint import manifest as mf

    d = Path(a.engines)
    m = mf.read(d, verify=a.verify)
    if a.json:
        print(json.dumps(m, indent=1))
        return 0
    spec = m["model"]
    print(f"{d}: {spec['family']} {spec['n_layers']} layers, hidden {spec['dim']}, heads {spec['n_heads']}/"
          f"{spec['n_kv_heads']} kv, vocab {spec['vocab_size']}, context {spec['max_seq_len']}")
    print(f"source: {m['source']['path']} ({m['source']['kind']}, sha256 {m['source']['sha256'][:12]})")
    attention = m.get("build_inputs", {}).get("attention", "plain")  # builds before lean-3: plain
    print(f"backend: {m['backend']} ({attention} attention graphs); drafters: {', '.join(m['drafters'])}")
    for role, e in m["engines"].items():
        size = mf.weights(m, e).get("bytes", 0)
        print(f"  {role:17} {e['path']:24} {e['precision']:12} {e['layers']:3} layers  {size / 1e6:8.1f} MB"
              + (f"  weights: {e['weights']}" if e.get("weights") else ""))
    from spork_trt.engines.default_target import default_target, source_path

    target = default_target(m)
    print(f"default target on this host (--dtype auto): {target.describe()}")
    if (target.device, target.dtype) == ("cpu", "int4"):
        from spork_trt.engines.cpu.engine import file_weight_paths

        print(f"  its weights: {file_weight_paths(source_path(m, checked=False))}")
    print("tools: " + ", ".join(f"{k} {v}" for k, v in m["tools"].items()))
    if a.verify:
        print(f"all {len(m['artifacts'])} artifacts match their sha256")
    return 0


def add_k8s_command(sub) -> None:
    from spork_trt.serving.k8s import K8sConfig as K

    k = sub.add_parser("k8s", help="kustomize manifests for a build: Triton Deployment with probes and drain, "
                       "Service, PodDisruptionBudget, HPA on the spork queue, prometheus-adapter rules",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    k.add_argument("--engines", default=str(K.engines), help="a build folder with its rendered repository (slots, "
                   "instances and context size the pods; default: %(default)s); the image holds it at /engines")
    k.add_argument("--out", default=str(K.out), help="manifests folder: base/ and overlays/{cpu,gpu} "
                   "(default: %(default)s)")
    k.add_argument("--image", default=K.image, help="the container image (default: %(default)s)")
    k.add_argument("--namespace", default=K.namespace, help="(default: the one kubectl applies to)")
    k.add_argument("--replicas", type=int, default=K.replicas, help="and the autoscaler's minimum (default: "
                   "%(default)s)")
    k.add_argument("--max-replicas", type=int, default=K.max_replicas, help="(default: %(default)s)")
    k.add_argument("--drain", type=int, default=K.drain_s, metavar="S", help="serve --drain-timeout; the pod's "
                   "grace period adds 30 s (default: %(default)s)")
    k.add_argument("--queue-target", type=int, default=K.queue_target,
                   help="queued requests per pod above which the autoscaler adds pods (default: %(default)s)")


def k8s(a: argparse.Namespace) -> int:
    from spork_trt.serving.k8s import K8sConfig, render

    written = render(K8sConfig(engines=Path(a.engines), out=Path(a.out), image=a.image, namespace=a.namespace,
                               replicas=a.replicas, max_replicas=a.max_replicas, drain_s=a.drain,
                               queue_target=a.queue_target))
    print(f"wrote {len(written)} files under {a.out}: kubectl apply -k {a.out}/overlays/cpu (or gpu)")
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
        if a.command == "self-data":
            return self_data(a)
        if a.command == "pack":
            return pack(a)
        if a.command == "train-draft":
            return train_draft(a)
        if a.command == "convert-head":
            return convert_head(a)
        if a.command == "k8s":
            return k8s(a)
        from spork_trt.export.build import BuildConfig, build

        drafts = tuple(a.draft) if a.draft else BuildConfig.drafts
        build(BuildConfig(model=a.model, out=Path(a.out), precision=a.precision, drafts=drafts,
                          verifier_layers=a.verifier_layers, backend=a.backend, force=a.force, store=a.store,
                          head=a.head, attention=a.attention))
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


sys.exit(main())
