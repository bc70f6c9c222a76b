"""The draft head's training data (`export train-draft`): the target's features and top-1 labels, computed once and
cached (memory-mapped .npy), the held-out split, padded batches, and the draft vocabulary."""
from __future__ import annotations

import hashlib
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spork_trt import atomic
from spork_trt.spec.draft_head import target_to_draft

HELDOUT_EVERY = 20  # 1 sequence in 20 (by id hash) is held out


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
    from spork_trt.checkpoint.transformer import causal_mask

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
                atomic.write_text(progress, f"{done}\n")  # the rows before it are flushed: a resume starts there
                last = time.perf_counter()
                rate = (b - offsets[start]) / (last - t0)
                stage(f"features: {done}/{len(seqs)} sequences, {rate:.0f} tokens/s, "
                      f"~{(n - b) / max(rate, 1e-9) / 60:.0f} min left")
    for name, a in (("tokens.npy", np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])),
                    ("offsets.npy", offsets)):
        with atomic.open(folder / name, "wb") as fh:
            np.save(fh, a)
    atomic.write_text(folder / "done", "ok\n")  # last: the cache is complete
    return extract(target, seqs, taps, folder)


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
