"""`python -m export train-draft`: the draft head (draft_head.py) trained on the target's own text (self-data).

  1. features: the target (torch reference) runs every sequence once; its hidden states after the tapped layers
     (fp16) and its own top-1 next token at every position are cached in OUT/features-*/ (memory-mapped .npy)
  2. the draft vocabulary: the N most frequent of those top-1 tokens in the training sequences
  3. training, with training-time test: the head is unrolled `steps` times; step j at position p reads its own
     step j-1 output at p-1 (not the target's feature) and attends exactly what a depth-j draft node would (the
     teacher-forced entries before its chain, then its chain), so training sees what drafting does
  4. held-out sequences (1 in 20 by id, never trained on): per-step top-1 agreement with the target on their
     answers, and the mean accepted length of a greedy chain drafted to depth `steps` (simulated exactly from those
     agreements)
Checkpoints (safetensors: head, optimizer state; state.json) every epoch; `--resume` continues from them.
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..draft_head import DraftHead, HeadConfig, load_head, target_to_draft
from ..errors import UserError
from . import artifacts

HELDOUT_EVERY = 20  # 1 sequence in 20 (by id hash) is held out


@dataclass(frozen=True)
class TrainConfig:
    data: Path = Path("results/selfdata")  # a self-data folder (answers.jsonl)
    out: Path = Path("results/draft_head")
    model: str | None = None  # the target checkpoint (None: the embedded default)
    taps: tuple[int, ...] = ()  # () = the last layer (EAGLE-1); several = EAGLE-3 style fusion
    vocab: int = 8192  # draft vocabulary size
    steps: int = 3  # training-time test unroll (1 = teacher forcing only)
    epochs: int = 4
    lr: float = 1e-3
    batch: int = 8  # sequences per optimizer step
    max_len: int = 640  # tokens per sequence (longer ones are cut)
    limit: int | None = None  # use only the first N training sequences (data-size lever)
    device: str = "cpu"
    seed: int = 0
    resume: bool = False
    feature_norm: bool = True  # the head normalises g before fc (HeadConfig.feature_norm)
    # soft: cross-entropy against the target's whole next-token distribution over the draft vocabulary (EAGLE's
    # distillation; recomputed from the cached last-layer feature, so it needs the last layer tapped last);
    # hard: against its top-1 token only; auto: soft where the taps allow it
    loss: str = "auto"


def stage(msg: str) -> None:
    print(f"[train-draft] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Features:
    tokens: np.ndarray  # [N] int32
    labels: np.ndarray  # [N] int32: the target's top-1 next token at each position
    feats: np.ndarray  # [N, k*C] float16
    offsets: np.ndarray  # [S + 1] int64: sequence s is [offsets[s], offsets[s + 1])

    def seq(self, s: int) -> slice:
        return slice(int(self.offsets[s]), int(self.offsets[s + 1]))

    def __len__(self) -> int:
        return len(self.offsets) - 1


def heldout(seq_id: str) -> bool:
    return int(hashlib.sha256(seq_id.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def extract(target, seqs: list[list[int]], taps: tuple[int, ...], folder: Path, batch: int | None = None) -> Features:
    """The target's features and top-1 labels over `seqs`, computed once into `folder` (reused when complete; an
    interrupted extraction resumes from the last sequence it recorded), `batch` sequences per forward (default: one
    on the CPU, 32 on a GPU)."""
    names = ("tokens", "labels", "feats", "offsets")
    if (folder / "done").is_file():
        return Features(*(np.load(folder / f"{n}.npy", mmap_mode="r", allow_pickle=False) for n in names))
    folder.mkdir(parents=True, exist_ok=True)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    n, width = int(offsets[-1]), len(taps) * target.cfg.dim
    progress = folder / "progress"
    start = int(progress.read_text()) if progress.is_file() else 0
    mode = "r+" if start else "w+"
    feats = np.lib.format.open_memmap(folder / "feats.npy", mode, np.float16, (n, width))  # [N, k*C]
    labels = np.lib.format.open_memmap(folder / "labels.npy", mode, np.int32, (n,))  # [N]
    if start:
        stage(f"features: resuming after {start}/{len(seqs)} sequences")
    t0, last = time.perf_counter(), time.perf_counter()
    dev = next(target.parameters()).device  # the target's device (train-draft --device cuda: there, in fp32)
    from ..model import causal_mask

    per = batch or (1 if dev.type == "cpu" else 32)  # sequences per forward (right-padded; causal: pads unseen)
    with torch.no_grad():
        for i in range(start, len(seqs), per):
            group = seqs[i:i + per]
            t = max(map(len, group))
            tok = torch.tensor([s + [0] * (t - len(s)) for s in group], device=dev)  # [B, T]
            out = target(tok, torch.arange(t, device=dev)[None].expand(len(group), t),
                         causal_mask(0, t, len(group)).to(dev), taps=taps)
            hidden = out.hidden.cpu().numpy().astype(np.float16)  # [B, T, k*C]
            top = out.logits.argmax(-1).cpu().numpy()  # [B, T]
            for j, s in enumerate(group):
                a, b = offsets[i + j], offsets[i + j + 1]
                feats[a:b] = hidden[j, :len(s)]
                labels[a:b] = top[j, :len(s)]
            done = i + len(group)
            if time.perf_counter() - last > 15 or done == len(seqs):
                feats.flush()
                labels.flush()
                progress.write_text(f"{done}\n")
                last = time.perf_counter()
                rate = (b - offsets[start]) / (last - t0)
                stage(f"features: {done}/{len(seqs)} sequences, {rate:.0f} tokens/s, "
                      f"~{(n - b) / max(rate, 1e-9) / 60:.0f} min left")
    np.save(folder / "tokens.npy", np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs]))
    np.save(folder / "offsets.npy", offsets)
    (folder / "done").write_text("ok\n")
    return extract(target, seqs, taps, folder)


class StepKV:
    """The head's attention over every unrolled step: step j's keys/values after those of steps 1..j-1."""

    def __init__(self) -> None:
        self.k: list[torch.Tensor] = []  # per step [B, Hkv, T, D]
        self.v: list[torch.Tensor] = []

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k.append(k)
        self.v.append(v)
        return torch.cat(self.k, dim=2), torch.cat(self.v, dim=2)  # [B, Hkv, j*T, D]


def step_mask(j: int, t: int, valid: torch.Tensor) -> torch.Tensor:
    """[B, T, j*T]: step j's query at p sees step 1 at s <= p-j+1 (the committed entries and its chain's root) and
    step i at p-j+i for i = 2..j (its own chain). valid [B, T]: real (not padding) positions."""
    p = torch.arange(t)
    blocks = [p[None, :] <= p[:, None] - j + 1]  # [T, T] step 1
    blocks += [p[None, :] == p[:, None] - j + i for i in range(2, j + 1)]
    m = torch.cat(blocks, dim=1)[None] & valid.repeat(1, j)[:, None, :]  # [B, T, j*T]
    m[:, p, (j - 1) * t + p] = True  # a node always sees itself (padding rows too: no empty softmax)
    return m


class Teacher(torch.nn.Module):
    """The target's next-token distribution over the draft vocabulary, from its last layer's output (a feature):
    softmax(lm_head[d2t](norm(x)))."""

    def __init__(self, target, d2t: torch.Tensor) -> None:
        super().__init__()
        self.norm = target.norm
        self.register_buffer("w", target.lm_head.weight.detach()[d2t].clone())  # [N, C]

    @torch.no_grad()
    def forward(self, last: torch.Tensor) -> torch.Tensor:
        """last [B, T, C] -> probabilities [B, T, N]"""
        return torch.softmax(F.linear(self.norm(last), self.w).float(), dim=-1)


def unroll(head: DraftHead, embed, tokens, feats, labels, valid, steps: int, t2d: torch.Tensor,
           teacher: Teacher | None = None):
    """Run `steps` unrolled head steps over a padded batch; returns per step (loss, correct [B, T], counted [B, T]).
    tokens, labels [B, T] (target ids); feats [B, T, k*C]; valid [B, T]. With a `teacher` the loss is the
    cross-entropy against its distribution at p+1 (the last C columns of feats: the last layer's output), else
    against the target's top-1."""
    b, t = tokens.shape
    pos = torch.arange(t)[None].expand(b, t)
    emb = embed(tokens[:, 1:].clamp(min=0))  # [B, T-1, C]: x_{p+1}
    emb = F.pad(emb, (0, 0, 0, 1))  # [B, T, C]
    want = F.pad(labels[:, 1:], (0, 1), value=-1)  # [B, T]: the target's top-1 for x_{p+2}
    has = valid & F.pad(valid[:, 1:], (0, 1), value=False)  # x_{p+1} and its label exist
    target = torch.where(has & (want >= 0), t2d[want.clamp(min=0)], torch.full_like(want, -100))  # draft ids
    soft = None if teacher is None else F.pad(teacher(feats[:, 1:, -head.hc.dim:]), (0, 0, 0, 1))  # [B, T, N]
    kv, g, out = StepKV(), head.fuse(feats), []
    for j in range(1, steps + 1):
        h, logits = head(emb, g, pos, step_mask(j, t, valid), kv)
        counted = has & (pos >= j - 1)  # a depth-j node needs a chain root at p-j+1 >= 0
        tj = torch.where(counted, target, torch.full_like(target, -100))
        if soft is None:
            loss = F.cross_entropy(logits.reshape(b * t, -1).float(), tj.reshape(-1), ignore_index=-100)
        else:
            rows = tj >= 0  # [B, T]
            loss = -(soft[rows] * F.log_softmax(logits[rows].float(), dim=-1)).sum() / rows.sum().clamp(min=1)
        correct = (head.d2t[logits.argmax(-1)] == want) & counted
        out.append((loss, correct, counted))
        g = F.pad(h[:, :-1], (0, 0, 1, 0))  # step j+1 at p reads step j's output at p-1
    return out


def by_length(f: Features, order: list[int], batch: int, window: int = 16) -> list[int]:
    """`order` with each run of `window` batches sorted by length: batches of similar lengths (less padding),
    still shuffled between runs."""
    span = batch * window
    length = lambda s: f.seq(s).stop - f.seq(s).start  # noqa: E731
    return [s for i in range(0, len(order), span) for s in sorted(order[i:i + span], key=length)]


def batches(f: Features, seqs: list[int], size: int, max_len: int, device: str):
    """Padded batches (tokens, labels, feats, valid) of `size` sequences from `seqs` (indices into f)."""
    for i in range(0, len(seqs), size):
        group = [f.seq(s) for s in seqs[i:i + size]]
        t = min(max_len, max(sl.stop - sl.start for sl in group))
        tok = torch.full((len(group), t), -1, dtype=torch.long)
        lab = torch.full((len(group), t), -1, dtype=torch.long)
        fe = torch.zeros(len(group), t, f.feats.shape[1])
        valid = torch.zeros(len(group), t, dtype=torch.bool)
        for r, sl in enumerate(group):
            n = min(t, sl.stop - sl.start)
            tok[r, :n] = torch.from_numpy(np.asarray(f.tokens[sl.start:sl.start + n], dtype=np.int64))
            lab[r, :n] = torch.from_numpy(np.asarray(f.labels[sl.start:sl.start + n], dtype=np.int64))
            fe[r, :n] = torch.from_numpy(np.asarray(f.feats[sl.start:sl.start + n], dtype=np.float32))
            valid[r, :n] = True
        yield tok.to(device), lab.to(device), fe.to(device), valid.to(device)


CONFIDENCE = (0.0, 0.2, 0.4, 0.6, 0.8, 0.95)  # lower edges of the target's top-1 probability buckets


@dataclass(frozen=True)
class Evaluation:
    agreement: list[float]  # per step: top-1 agreement with the target on held-out text
    accepted_length: float  # mean tokens a greedy chain of depth `steps` commits per step (accepted + 1)
    tokens: int
    # with a teacher: per CONFIDENCE bucket of the target's own top-1 probability for the predicted token, the share
    # of scored tokens in it and the depth-1 agreement there (hard text, or a weak head?)
    by_confidence: list[dict] | None = None


def evaluate(head, embed, f: Features, seqs: list[int], steps: int, t2d, cfg: TrainConfig,
             starts: list[int], teacher: Teacher | None = None) -> Evaluation:
    """Held-out agreement where drafting happens: predictions of answer tokens only (x_{p+2} at or after the
    sequence's answer start, `starts[s]`). The chat template's system prompt, the same in every sequence, would
    otherwise be scored too, and a head learns it by heart."""
    hits, counts = [0] * steps, [0] * steps
    chain, roots = 0.0, 0
    edges = torch.tensor(CONFIDENCE[1:])
    b_hits, b_counts = torch.zeros(len(CONFIDENCE)), torch.zeros(len(CONFIDENCE))
    order = by_length(f, seqs, cfg.batch, len(seqs))
    with torch.no_grad():
        for i, (tok, lab, fe, valid) in enumerate(batches(f, order, cfg.batch, cfg.max_len, cfg.device)):
            first = torch.tensor([starts[s] for s in order[i * cfg.batch:(i + 1) * cfg.batch]], device=tok.device)
            answer = torch.arange(tok.shape[1], device=tok.device)[None] + 2 >= first[:, None]  # [B, T]
            out = [(loss, correct & answer, counted & answer)
                   for loss, correct, counted in unroll(head, embed, tok, fe, lab, valid, steps, t2d)]
            for j, (_, correct, counted) in enumerate(out):
                hits[j] += int(correct.sum())
                counts[j] += int(counted.sum())
            if teacher is not None:  # the target's top-1 probability at p+1, for x_{p+2}
                conf = F.pad(teacher(fe[:, 1:, -head.hc.dim:]).amax(-1), (0, 1)).cpu()  # [B, T]
                bucket = torch.bucketize(conf, edges, right=True)[out[0][2].cpu()]
                b_counts += torch.bincount(bucket, minlength=len(CONFIDENCE)).float()
                b_hits += torch.bincount(bucket, out[0][1].cpu()[out[0][2].cpu()].float(), len(CONFIDENCE))
            # a chain rooted at r accepts depth j when step j is right at r + j - 1, and every depth before it
            alive = out[0][2].clone()  # [B, T] roots with a depth-1 node
            roots += int(alive.sum())
            for j, (_, correct, counted) in enumerate(out):
                shifted = F.pad(correct[:, j:], (0, j), value=False)  # [B, T] at the root's index
                alive &= shifted
                chain += float(alive.sum())
    by_conf = None if teacher is None else [
        {"confidence": lo, "share": float(n / max(b_counts.sum(), 1)), "agreement": float(h / max(n, 1))}
        for lo, h, n in zip(CONFIDENCE, b_hits, b_counts)]
    return Evaluation([h / max(c, 1) for h, c in zip(hits, counts)], 1 + chain / max(roots, 1), counts[0], by_conf)


def train_draft(cfg: TrainConfig, target=None) -> dict:
    """Train (or resume) a head for `target` (a model.Transformer; None: cfg.model's checkpoint)."""
    from ..weights import load_checkpoint

    torch.manual_seed(cfg.seed)
    if cfg.epochs < 1 or cfg.steps < 1 or cfg.batch < 1 or cfg.lr <= 0:
        raise UserError("--epochs, --steps and --batch must be >= 1 and --lr > 0")
    if cfg.loss not in ("auto", "soft", "hard"):
        raise UserError(f"--loss {cfg.loss!r}: auto, soft or hard")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    ck = None if target is not None else load_checkpoint(cfg.model)
    target = (target if target is not None else ck.model).eval()
    data = data_folder(cfg.data, ck)
    rows, recipe = artifacts.training_rows(data, assistant_header(ck))
    if not rows:
        raise UserError(f"{data} holds no sequences: run `python -m export self-data` first")
    mcfg = target.cfg
    taps = cfg.taps or (mcfg.n_layers,)
    if cfg.loss == "soft" and taps[-1] != mcfg.n_layers:
        raise UserError(f"--loss soft reads the target's distribution from its last layer's output: end --taps with "
                        f"{mcfg.n_layers} (got {','.join(map(str, taps))}), or use --loss hard")
    soft = cfg.loss == "soft" or (cfg.loss == "auto" and taps[-1] == mcfg.n_layers)
    hc = HeadConfig.for_target(mcfg, taps, cfg.vocab, cfg.feature_norm)
    seqs = [r["ids"][:cfg.max_len] for r in rows]
    key = hashlib.sha256(json.dumps([len(seqs), seqs[-1], taps, cfg.max_len]).encode()).hexdigest()[:12]
    stage(f"{len(seqs)} sequences, {sum(map(len, seqs))} tokens; target features after layers {taps}")
    f = extract(target.to(cfg.device), seqs, taps, cfg.out / f"features-{key}")
    starts = [int(r.get("n_prompt", 0)) for r in rows]  # where each sequence's answer begins
    test = [i for i, r in enumerate(rows) if heldout(str(r["id"]))]
    train = [i for i, r in enumerate(rows) if not heldout(str(r["id"]))][:cfg.limit]
    vocab = draft_vocab(f, train, cfg.vocab, mcfg.vocab_size)
    head = DraftHead(hc)
    head.init_from_target(target, vocab.d2t)
    embed = target.embed.requires_grad_(False)
    head, embed, t2d = head.to(cfg.device), embed.to(cfg.device), vocab.t2d.to(cfg.device)
    teacher = Teacher(target, vocab.d2t).to(cfg.device) if taps[-1] == mcfg.n_layers else None  # soft labels
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    per_epoch = math.ceil(len(train) / cfg.batch)
    total_steps, warm = per_epoch * cfg.epochs, max(1, per_epoch * cfg.epochs // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine to 0
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))
    state = {"epoch": 0, "losses": [], "evals": []}
    ckpt = cfg.out / "checkpoint"
    if cfg.resume and (ckpt / "state.json").is_file():
        state = resume(ckpt, head, opt, sched)
        stage(f"resumed after epoch {state['epoch']}")
    params = sum(p.numel() for p in head.parameters()) / 1e6
    stage(f"{len(train)} training / {len(test)} held-out sequences; draft vocabulary {cfg.vocab} tokens covers "
          f"{vocab.coverage:.1%} of the target's top-1 tokens; {params:.1f}M parameters; {cfg.steps} unrolled steps; "
          f"{'soft' if soft else 'hard'} labels")
    if not state["evals"]:  # the untrained head (LM head rows copied from the target): what training adds
        state["evals"] = [asdict(evaluate(head.eval(), embed, f, test, cfg.steps, t2d, cfg, starts, teacher))]
    rng = np.random.default_rng(cfg.seed)
    orders = [by_length(f, rng.permutation(train).tolist(), cfg.batch) for _ in range(cfg.epochs)]
    ev = None
    for epoch in range(state["epoch"], cfg.epochs):
        loss = train_epoch(head, embed, f, orders[epoch], t2d, opt, sched, cfg, f"epoch {epoch + 1}/{cfg.epochs}",
                           teacher if soft else None)
        ev = evaluate(head.eval(), embed, f, test, cfg.steps, t2d, cfg, starts, teacher)
        state = {"epoch": epoch + 1, "losses": state["losses"] + [round(loss, 4)],
                 "evals": state["evals"] + [asdict(ev)]}
        stage(f"epoch {epoch + 1}: loss {loss:.3f}; held-out agreement by depth "
              f"{', '.join(f'{a:.3f}' for a in ev.agreement)}; chain accepted length {ev.accepted_length:.2f}")
        checkpoint(ckpt, head, opt, sched, state)
    if ev is None:  # nothing left to train: the saved head, evaluated as this version evaluates
        ev = evaluate(head.eval(), embed, f, test, cfg.steps, t2d, cfg, starts, teacher)
        stage(f"held-out agreement by depth {', '.join(f'{a:.3f}' for a in ev.agreement)}; chain accepted length "
              f"{ev.accepted_length:.2f}")
    meta = {"data": str(data), "recipe": recipe, "target_sha256": recipe.get("target_sha256"),
            "train_sequences": len(train), "heldout_sequences": len(test),
            "train_tokens": int(sum(f.seq(s).stop - f.seq(s).start for s in train)),
            "vocab_coverage": vocab.coverage,
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
            "taps": list(taps), "labels": "soft" if soft else "hard", **state, "heldout": asdict(ev)}
    head.save(cfg.out, meta)
    (cfg.out / "report.json").write_text(json.dumps(meta, indent=1) + "\n")
    stage(f"saved {cfg.out / 'head.safetensors'}")
    return meta


def data_folder(data: Path, ck) -> Path:
    """`--data`: a folder, or "shipped": the corpus that ships for the target checkpoint (its sha256)."""
    if str(data) != "shipped":
        return data
    from . import manifest as mf

    found = artifacts.shipped(mf.checkpoint_sha256(ck.path)) if ck is not None else None
    if found is None:
        raise UserError("--data shipped: no corpus ships for this checkpoint; make one with `python -m export "
                        "self-data` and pass its folder")
    return found


def assistant_header(ck) -> list[int]:
    """The chat template's assistant-turn opening (where an answer starts in a packed corpus); [] without one."""
    if ck is None:
        return []
    from ..tokenizer import load_tokenizer

    tok = load_tokenizer(ck.path, ck.kind, ck.cfg.eos_token_ids)
    if not tok.has_chat_template:
        return []
    ids = tok.encode_prompt("x")  # [..., <|im_start|>, assistant, \n]: the last turn opening
    return ids[max(i for i, t in enumerate(ids) if t == ids[0]):]


@dataclass(frozen=True)
class Vocab:
    d2t: torch.Tensor  # [N] draft id -> target id (ascending)
    t2d: torch.Tensor  # [V] target id -> draft id; -100 (ignored by the loss) outside the draft vocabulary
    coverage: float  # share of the training labels inside it


def draft_vocab(f: Features, train: list[int], n: int, v: int) -> Vocab:
    """The `n` most frequent target top-1 tokens of the training sequences (FR-Spec / EAGLE-3 draft vocabulary)."""
    counts = Counter(np.concatenate([np.asarray(f.labels[f.seq(s)]) for s in train]).tolist())
    d2t = torch.tensor(sorted(t for t, _ in counts.most_common(n)), dtype=torch.long)  # [N]
    return Vocab(d2t, target_to_draft(d2t, v), sum(counts[int(t)] for t in d2t) / sum(counts.values()))


def train_epoch(head, embed, f: Features, order: list[int], t2d, opt, sched, cfg: TrainConfig, what: str,
                teacher: Teacher | None) -> float:
    """One pass over `order` (sequence indices); the mean loss over unrolled steps and batches."""
    head.train()
    total, n, t0 = 0.0, 0, time.perf_counter()
    last = t0
    for tok, lab, fe, valid in batches(f, order, cfg.batch, cfg.max_len, cfg.device):
        out = unroll(head, embed, tok, fe, lab, valid, cfg.steps, t2d, teacher)
        loss = sum(o[0] for o in out) / len(out)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        total, n = total + loss.item(), n + 1
        if time.perf_counter() - last > 30:
            last = time.perf_counter()
            left = (last - t0) / n * (math.ceil(len(order) / cfg.batch) - n)
            stage(f"{what}: batch {n}, loss {total / n:.3f}, ~{left / 60:.0f} min left in the epoch")
    return total / max(n, 1)


def checkpoint(d: Path, head, opt, sched, state: dict) -> None:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(d / "head.safetensors"))
    tensors = {}
    for i, p in enumerate(head.parameters()):
        for name, v in opt.state.get(p, {}).items():
            tensors[f"{i}.{name}"] = v.reshape(1) if v.dim() == 0 else v.contiguous()
    save_file(tensors, str(d / "optimizer.safetensors"))
    (d / "state.json").write_text(json.dumps({**state, "sched": sched.last_epoch}) + "\n")


def resume(d: Path, head, opt, sched) -> dict:
    from safetensors.torch import load_file

    head.load_state_dict(load_file(str(d / "head.safetensors")))
    saved = load_file(str(d / "optimizer.safetensors"))
    for i, p in enumerate(head.parameters()):
        st = {k.split(".", 1)[1]: v for k, v in saved.items() if k.split(".", 1)[0] == str(i)}
        if st:
            st["step"] = st["step"].reshape(())
            opt.state[p] = st
    state = json.loads((d / "state.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": replaying its position
        for _ in range(state.pop("sched")):
            sched.step()
    return state


__all__ = ["TrainConfig", "train_draft", "load_head"]
