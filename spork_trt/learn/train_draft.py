"""`python -m export train-draft`: the draft head (draft_head.py) trained on the target's own text (self-data).

  1. features (head_data.py): the target (torch reference) runs every sequence once; its hidden states after the
     tapped layers (fp16) and its own top-1 next token at every position are cached in OUT/features-*/
     (memory-mapped .npy)
  2. the draft vocabulary: the N most frequent of those top-1 tokens in the training sequences
  3. training, with training-time test (unroll.py): the head is unrolled `steps` times; step j at position p reads
     its own step j-1 output at p-1 (not the target's feature) and attends exactly what a depth-j draft node would
     (the teacher-forced entries before its chain, then its chain), so training sees what drafting does
  4. held-out sequences (1 in 20 by id, never trained on; head_eval.py): per-step top-1 agreement with the target on
     their answers, and the mean accepted length of a greedy chain drafted to depth `steps` (simulated exactly from
     those agreements)
Checkpoints (safetensors: head, optimizer state; state.json) every epoch; `--resume` continues from them.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from spork_trt import atomic
from spork_trt.spec.draft_head import DraftHead, HeadConfig, load_head
from spork_trt.errors import UserError
from spork_trt.export import artifacts
from spork_trt.learn.head_data import Features, batches, by_length, draft_vocab, extract, heldout, stage
from spork_trt.learn.head_eval import evaluate
from spork_trt.learn.unroll import Teacher, unroll


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


def train_draft(cfg: TrainConfig, target=None) -> dict:
    """Train (or resume) a head for `target` (a model.Transformer; None: cfg.model's checkpoint)."""
    from spork_trt.checkpoint.weights import load_checkpoint

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
    atomic.write_text(cfg.out / "report.json", json.dumps(meta, indent=1) + "\n")
    stage(f"saved {cfg.out / 'head.safetensors'}")
    return meta


def data_folder(data: Path, ck) -> Path:
    """`--data`: a folder, or "shipped": the corpus that ships for the target checkpoint (its sha256)."""
    if str(data) != "shipped":
        return data
    from spork_trt.checkpoint import manifest as mf

    found = artifacts.shipped(mf.checkpoint_sha256(ck.path)) if ck is not None else None
    if found is None:
        raise UserError("--data shipped: no corpus ships for this checkpoint; make one with `python -m export "
                        "self-data` and pass its folder")
    return found


def assistant_header(ck) -> list[int]:
    """The chat template's assistant-turn opening (where an answer starts in a packed corpus); [] without one."""
    if ck is None:
        return []
    from spork_trt.checkpoint.tokenizer import load_tokenizer

    tok = load_tokenizer(ck.path, ck.kind, ck.cfg.eos_token_ids)
    if not tok.has_chat_template:
        return []
    ids = tok.encode_prompt("x")  # [..., <|im_start|>, assistant, \n]: the last turn opening
    return ids[max(i for i, t in enumerate(ids) if t == ids[0]):]


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
    with atomic.path(d / "head.safetensors") as tmp:
        save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(tmp))
    tensors = {}
    for i, p in enumerate(head.parameters()):
        for name, v in opt.state.get(p, {}).items():
            tensors[f"{i}.{name}"] = v.reshape(1) if v.dim() == 0 else v.contiguous()
    with atomic.path(d / "optimizer.safetensors") as tmp:
        save_file(tensors, str(tmp))
    atomic.write_text(d / "state.json", json.dumps({**state, "sched": sched.last_epoch}) + "\n")


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
