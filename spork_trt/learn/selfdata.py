"""`python -m export self-data`: the target's own text, the training data of the learned drafts (draft head,
datastore). Never benchmark prompts: every prompt is synthesized by the target or cut from the Python standard
library (PSF license).

Two stages, each a JSONL file appended as requests finish (resumable: a rerun skips what is there; deterministic
for a seed: sampled requests draw the same tokens batched as alone):
  prompts.jsonl  one line per attempt: Magpie prompts (the target samples a user turn from its chat template's
                 user-turn prefix alone; kept when it ends its turn within the limit and is new), opener prompts (the
                 same, begun with an instruction verb: "Write", "Explain", "Solve", ...) and standard-library
                 function-completion prompts (a signature and docstring, "Complete the following Python function")
  answers.jsonl  the target's greedy answer to every kept prompt, through the chat template: the token ids of the
                 whole sequence (template + prompt + answer) and where the answer starts
Both run on one engine core (continuous batching, lossless n-gram speculation: greedy tokens are plain decoding's).
"""
from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from spork_trt import atomic
from spork_trt.config import DEVICE_DTYPE, GenerateConfig, SamplingConfig, SpecConfig
from spork_trt.errors import UserError
from spork_trt.export.artifacts import ANSWERS, COUNTS, RECIPE, read_jsonl
from spork_trt.export.code_prompts import stdlib_candidates
from spork_trt.loop.generate import run_many

PROMPTS = "prompts.jsonl"
SENTINEL = "\x00SPORK_USER_TURN\x00"  # cut point: the chat template's text before the user's content
# Opener prompts begin with one of these instruction verbs, in turn (the most common root verbs of instruction-tuning
# data, as Self-Instruct and Alpaca count them, plus a few for role-play and reasoning): Magpie from the bare prefix
# writes mostly "I'm ..." and "Can you ..." requests; these make the target write the other kinds of task too.
OPENERS = ("Write", "Explain", "Describe", "Create", "Generate", "Give", "List", "Summarize", "Rewrite", "Edit",
           "Compare", "Analyze", "Identify", "Classify", "Extract", "Translate", "Suggest", "Design", "Compose",
           "Imagine", "Pretend", "Solve", "Calculate", "Find", "Tell", "Evaluate", "Discuss", "Outline", "Convert",
           "Draft")
SEED_OFFSET = {"magpie": 0, "opener": 500_000_000}  # each sampled source draws its own seeds


@dataclass(frozen=True)
class SelfDataConfig:
    engines: Path = Path("engines/default")
    out: Path = Path("results/selfdata")
    magpie: int = 1024  # Magpie prompts to keep
    stdlib: int = 512  # standard-library function prompts
    openers: int = 0  # Magpie prompts begun with an instruction verb (OPENERS) to keep
    max_prompt_tokens: int = 96  # a Magpie user turn longer than this is dropped
    max_code_tokens: int = 384  # a standard-library prompt longer than this is skipped
    max_new_tokens: int = 256  # answer length
    temperature: float = 0.9  # Magpie prompt sampling
    top_p: float = 0.95
    slots: int = 16
    seed: int = 0
    model: str | None = None  # set (or device cuda): the target from this checkpoint on torch, not the --engines build
    device: str = "cpu"  # cuda: the device engine (CUDA graphs), many slots at once
    dtype: str = DEVICE_DTYPE  # the device engine's precision (device cuda): the deployed target's text


def stage(msg: str) -> None:
    print(f"[self-data] {msg}", file=sys.stderr, flush=True)


class Appender:
    """Appends JSON lines and flushes each, so an interrupted run loses at most the requests in flight."""

    def __init__(self, path: Path) -> None:
        self.path = path
        text = path.read_text() if path.is_file() else ""
        if text and not text.endswith("\n"):
            atomic.write_text(path, text[:text.rfind("\n") + 1])  # drop a partial last line
        self.fh = path.open("a")

    def write(self, row: dict) -> None:
        self.fh.write(json.dumps(row) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


class Progress:
    def __init__(self, what: str, total: int, done: int) -> None:
        self.what, self.total, self.done, self.tokens = what, total, done, 0
        self.t0 = self.last = time.perf_counter()

    def tick(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        now = time.perf_counter()
        if now - self.last >= 15 or self.done == self.total:
            self.last = now
            rate = self.tokens / (now - self.t0)
            stage(f"{self.what}: {self.done}/{self.total}, {rate:.0f} tokens/s")


def user_turn_prefix(tok) -> list[int]:
    """Token ids of the chat template rendered up to where the user's text begins (Magpie's pre-query template)."""
    if not tok.has_chat_template:
        raise UserError("self-data synthesizes prompts from the chat template: this model has none")
    text = tok.hf.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    return list(tok.hf.encode(text[:text.index(SENTINEL)], add_special_tokens=False))


def stdlib_functions(seed: int, n: int, max_tokens: int, tok) -> list[dict]:
    """`n` function-completion prompts (signature + docstring) from this Python's standard library, chosen with
    `seed` (the first n of one seeded order)."""
    out = []
    for f in stdlib_candidates(seed):
        if len(out) == n:
            break
        if len(tok.encode_prompt(f["prompt"])) <= max_tokens:
            out.append({**f, "source": "stdlib", "kept": True})
    return out


def synthesize(rt, cfg: SelfDataConfig) -> list[dict]:
    """The kept prompts, each source in attempt order: the first `cfg.magpie` Magpie prompts, the standard-library
    prompts, the first `cfg.openers` opener prompts (appended last, so a run without them is a prefix of one with
    them); appended to prompts.jsonl as they come, resumed from it."""
    path = cfg.out / PROMPTS
    rows = read_jsonl(path)
    done = {r["id"] for r in rows}
    out = Appender(path)
    if sum(r["source"] == "stdlib" for r in rows) < cfg.stdlib:  # the first n of one seeded order: a larger n
        stage("collecting standard-library function prompts")   # extends a smaller one
        for r in stdlib_functions(cfg.seed, cfg.stdlib, cfg.max_code_tokens, rt.tokenizer):
            if r["id"] not in done:
                out.write(r)
                rows.append(r)
    for source, want in (("magpie", cfg.magpie), ("opener", cfg.openers)):
        sample_prompts(rt, cfg, source, want, rows, out)
    out.close()

    def kept(source: str) -> list[dict]:
        return sorted((r for r in rows if r["source"] == source and r["kept"]), key=lambda r: attempt(r["id"]))

    return kept("magpie")[:cfg.magpie] + [r for r in rows if r["source"] == "stdlib"][:cfg.stdlib] + \
        kept("opener")[:cfg.openers]


def attempt(prompt_id: str) -> int:
    return int(prompt_id.rsplit(":", 1)[1])


def sample_prompts(rt, cfg: SelfDataConfig, source: str, want: int, rows: list[dict], out: Appender) -> None:
    """Sample `source` prompts until `want` are kept (rows and the file get every attempt): "magpie" from the chat
    template's user-turn prefix alone, "opener" from it followed by the instruction verb OPENERS[attempt % len]."""
    kept = sum(r["kept"] for r in rows if r["source"] == source)
    if kept >= want:
        return
    stage(f"synthesizing {source} prompts ({kept}/{want} kept so far)")
    done = {r["id"] for r in rows}
    seen = {r["prompt"] for r in rows if r["kept"]}
    prefix = user_turn_prefix(rt.tokenizer)
    progress = Progress(f"{source} prompts", want, kept)
    state = {"kept": kept}
    lead = {}  # submission -> (its attempt's id, the opener's token ids)
    openers = [rt.tokenizer.hf.encode(o, add_special_tokens=False) for o in OPENERS] if source == "opener" else [[]]

    def attempts() -> Iterator:
        i = 0
        while state["kept"] < want:
            if f"{source}:{i}" not in done:
                opener = openers[i % len(openers)]
                sampling = SamplingConfig(cfg.temperature, top_p=cfg.top_p, seed=cfg.seed * 1_000_003 +
                                          SEED_OFFSET[source] + i)
                sub = rt.request(prefix + opener, GenerateConfig(cfg.max_prompt_tokens, sampling), "spork",
                                 SpecConfig())
                lead[sub] = (f"{source}:{i}", opener)
                yield sub
            i += 1

    for r in run_many(rt.engine, attempts(), cfg.slots, len(prefix) + cfg.max_prompt_tokens + 32):
        res = r.result()
        rid, opener = lead.pop(r.sub)
        text = rt.tokenizer.decode([*opener, *res.token_ids]).strip()
        ok = res.stop_reason == "eos" and len(text.split()) >= 4 and text not in seen
        if ok:
            seen.add(text)
            state["kept"] += 1
            progress.tick(len(res.token_ids))
        row = {"id": rid, "source": source, "prompt": text, "kept": ok}
        out.write(row)
        rows.append(row)


def answer(rt, cfg: SelfDataConfig, prompts: list[dict]) -> list[dict]:
    """The target's greedy answers (through the chat template), appended to answers.jsonl, resumed from it."""
    path = cfg.out / ANSWERS
    rows = read_jsonl(path)
    done = {r["id"] for r in rows}
    todo = [p for p in prompts if p["id"] not in done]
    progress = Progress("answers", len(prompts), len(prompts) - len(todo))
    if todo:
        stage(f"answering {len(todo)} prompts ({len(done)} done before)")

    ids = {}  # submission -> its prompt's id

    def requests() -> Iterator:
        for p in todo:
            sub = rt.request(rt.tokenizer.encode_prompt(p["prompt"]), GenerateConfig(cfg.max_new_tokens), "spork",
                             SpecConfig())
            ids[sub] = p["id"]
            yield sub

    out = Appender(path)
    max_len = cfg.max_code_tokens + cfg.max_new_tokens + 64
    for r in run_many(rt.engine, requests(), cfg.slots, max_len):
        res = r.result()
        row = {"id": ids.pop(r.sub), "ids": [*r.sub.prompt_ids, *res.token_ids], "n_prompt": len(r.sub.prompt_ids),
               "stop": res.stop_reason}
        out.write(row)
        rows.append(row)
        progress.tick(len(res.token_ids))
    out.close()
    order = {p["id"]: i for i, p in enumerate(prompts)}
    return sorted((r for r in rows if r["id"] in order), key=lambda r: order[r["id"]])


def runtime(cfg: SelfDataConfig):
    """(the runtime that writes the data, the target checkpoint's sha256): the --engines build (ONNX Runtime), or,
    with a --model or on a GPU, the checkpoint on torch (the device engine with CUDA graphs on cuda)."""
    from spork_trt.loop.runtime import Runtime
    from spork_trt.checkpoint.weights import default_gguf_path
    from spork_trt.checkpoint import manifest as mf

    if cfg.model is None and cfg.device == "cpu":
        return Runtime.from_engines(cfg.engines, load_head=False), mf.read(cfg.engines)["source"]["sha256"]
    rt = Runtime.load(cfg.model, cfg.device, cfg.dtype)
    return rt, mf.checkpoint_sha256(Path(cfg.model) if cfg.model else default_gguf_path())


def self_data(cfg: SelfDataConfig) -> dict:
    """Both stages; writes recipe.json (the settings, counts and the target's sha256) and returns it."""
    if min(cfg.magpie, cfg.stdlib, cfg.openers) < 0 or cfg.magpie + cfg.stdlib + cfg.openers == 0 or cfg.slots < 1:
        raise UserError("--magpie, --stdlib and --openers must be >= 0 (not all 0) and --slots >= 1")
    cfg.out.mkdir(parents=True, exist_ok=True)
    recipe_path = cfg.out / RECIPE
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items() if k not in ("out", "slots")}
    runs = []  # the counts of each run that made or extended this folder: answers are appended in that order
    if recipe_path.is_file():
        before = json.loads(recipe_path.read_text())
        old = {"model": None, "device": "cpu", "dtype": "bf16", "openers": 0,  # runs recorded before these existed
               **before["settings"]}
        if {k: v for k, v in old.items() if k not in COUNTS} != {k: v for k, v in settings.items() if k not in COUNTS}:
            raise UserError(f"{cfg.out} holds data made with other settings ({old}): pass another --out")
        runs = before.get("runs", [{k: old[k] for k in COUNTS}])
    if not runs or runs[-1] != {k: settings[k] for k in COUNTS}:
        runs.append({k: settings[k] for k in COUNTS})
    rt, target_sha = runtime(cfg)
    t0 = time.perf_counter()
    prompts = synthesize(rt, cfg)
    answers = answer(rt, cfg, prompts)
    recipe = {
        "settings": settings, "runs": runs, "target_sha256": target_sha, "python": platform.python_version(),
        "prompts": {k: sum(p["source"] == src for p in prompts) for k, src in COUNTS.items()},
        "tokens": {"total": sum(len(a["ids"]) for a in answers),
                   "answer": sum(len(a["ids"]) - a["n_prompt"] for a in answers)},
        "seconds_this_run": round(time.perf_counter() - t0, 1),
    }
    atomic.write_text(recipe_path, json.dumps(recipe, indent=1) + "\n")
    stage(f"done: {len(answers)} answers, {recipe['tokens']['answer']} answer tokens "
          f"({recipe['tokens']['total']} with prompts) in {cfg.out}")
    return recipe
