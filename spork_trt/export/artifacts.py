"""Learned draft artifacts that ship inside the package (spork_trt/artifacts/<name>/), one folder per target:
  corpus.npz     the datastore's text: the target's own answers (self-data), token ids joined by datastore.SEP
  head.safetensors  the learned draft head (`export train-draft`), when one ships
  manifest.json  the target's sha256, the data recipe, token counts, and the command that reproduces it

`python -m export pack` writes a folder from a self-data run; `python -m export build` finds the folder whose
target sha256 is the checkpoint's and builds the memory-mapped datastore from it into the engines folder.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from spork_trt import atomic
from spork_trt.checkpoint import manifest as mf
from spork_trt.spec.datastore import SEP, Datastore, join
from spork_trt.errors import UserError

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CORPUS, MANIFEST = "corpus.npz", "manifest.json"
ANSWERS, RECIPE = "answers.jsonl", "recipe.json"  # a self-data folder's (learn/selfdata.py) answers and recipe
COUNTS = {"magpie": "magpie", "stdlib": "stdlib", "openers": "opener"}  # count setting -> its source; a rerun may
# raise a count to extend a run
SELF_DATA = ("python -m export self-data --magpie {magpie} --stdlib {stdlib}{openers} --max-new-tokens {tokens} "
             "--seed {seed}")


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file that a run appends to (none when it is absent)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by an interrupted run: redone
            break
    return rows


def shipped(source_sha256: str, root: Path = ARTIFACTS) -> Path | None:
    """The artifact folder made for the checkpoint with this sha256, if one ships."""
    for m in sorted(root.glob(f"*/{MANIFEST}")):
        if json.loads(m.read_text()).get("target_sha256") == source_sha256:
            return m.parent
    return None


def corpus_sequences(data: Path) -> list[list[int]]:
    """The token sequences (chat template + prompt + the target's answer) of a self-data folder."""
    rows = read_jsonl(data / ANSWERS)
    if not rows:
        raise UserError(f"{data} has no {ANSWERS}: run `python -m export self-data --out {data}` first")
    return [r["ids"] for r in rows]


def pack(data: Path, out: Path) -> Path:
    """Write corpus.npz and manifest.json for the self-data run in `data` into `out`."""
    if not (data / RECIPE).is_file():
        raise UserError(f"{data} has no {RECIPE}: it is not a finished self-data run")
    recipe = json.loads((data / RECIPE).read_text())
    seqs = corpus_sequences(data)
    tokens = join(seqs)
    out.mkdir(parents=True, exist_ok=True)
    with atomic.open(out / CORPUS, "wb") as fh:
        np.savez_compressed(fh, tokens=tokens)
    manifest = {"target_sha256": recipe["target_sha256"], "recipe": recipe, "sequences": len(seqs),
                "tokens": int(len(tokens) - len(seqs)), "corpus_sha256": mf.sha256(out / CORPUS),
                "reproduce": reproduce(recipe)}
    atomic.write_text(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    print(f"[pack] {out / CORPUS}: {len(seqs)} sequences, {manifest['tokens']} tokens, "
          f"{(out / CORPUS).stat().st_size / 1e6:.1f} MB", file=sys.stderr)
    return out


def reproduce(recipe: dict) -> str:
    """The commands that remake a self-data run and pack it: one `self-data` per run that made or extended it (the
    corpus keeps the answers in the order they were written, so the order of the runs is part of the recipe)."""
    s = recipe["settings"]
    runs = recipe.get("runs") or [{k: s.get(k, 0) for k in COUNTS}]  # recorded before `runs` existed: one run
    steps = [SELF_DATA.format(magpie=r["magpie"], stdlib=r["stdlib"], tokens=s["max_new_tokens"], seed=s["seed"],
                              openers=f" --openers {r['openers']}" if r.get("openers") else "") for r in runs]
    return " && ".join(["python -m export build", *steps, "python -m export pack"])


def load_corpus(folder: Path) -> np.ndarray:
    """[N] int32 tokens joined by SEP, from a shipped or packed folder (no pickles)."""
    with np.load(folder / CORPUS, allow_pickle=False) as z:
        tokens = z["tokens"]
    if tokens.dtype != np.int32 or tokens.ndim != 1 or len(tokens) == 0 or tokens[-1] != SEP:
        raise UserError(f"{folder / CORPUS} is not a corpus (1-D int32 token ids, each sequence ended by {SEP})")
    return tokens


def store_source(store: str, source_sha256: str) -> tuple[Path | None, str]:
    """Where a build's datastore comes from: `store` "auto" (the shipped corpus for this checkpoint, if any), "none",
    a packed folder (corpus.npz) or a self-data folder (answers.jsonl). Returns (folder or None, what it is)."""
    if store == "none":
        return None, "none"
    if store == "auto":
        found = shipped(source_sha256)
        return found, f"shipped {found.name}" if found else "none (no shipped corpus for this checkpoint)"
    p = Path(store)
    if (p / CORPUS).is_file() or (p / ANSWERS).is_file():
        return p, str(p)
    raise UserError(f"--store {store}: use auto, none, a packed folder (with {CORPUS}) or a self-data folder (with "
                    f"{ANSWERS})")


def training_rows(data: Path, header: list[int]) -> tuple[list[dict], dict]:
    """What a head trains on, and its recipe: a self-data folder's answers.jsonl (ids, where each answer starts), or a
    packed or shipped folder's corpus.npz, whose sequence i gets the id "seq-i" and whose answer starts after the last
    `header` (the chat template's assistant-turn opening) in it."""
    if (data / ANSWERS).is_file():
        recipe = json.loads((data / RECIPE).read_text()) if (data / RECIPE).is_file() else {}
        return read_jsonl(data / ANSWERS), recipe
    if not (data / CORPUS).is_file():
        raise UserError(f"--data {data}: neither a self-data folder ({ANSWERS}) nor a packed one ({CORPUS}); run "
                        "`python -m export self-data` first, or pass --data shipped")
    tokens = load_corpus(data)
    ends = np.flatnonzero(tokens == SEP)
    rows = []
    for i, (a, b) in enumerate(zip(np.concatenate([[-1], ends[:-1]]) + 1, ends)):
        ids = tokens[a:b].tolist()
        n_prompt = next((j + len(header) for j in range(len(ids) - len(header), -1, -1)
                         if header and ids[j:j + len(header)] == header), 0)
        rows.append({"id": f"seq-{i}", "ids": ids, "n_prompt": n_prompt})
    manifest = json.loads((data / MANIFEST).read_text()) if (data / MANIFEST).is_file() else {}
    return rows, manifest.get("recipe", {})


def head_source(head: str, source_sha256: str) -> tuple[Path | None, str]:
    """Where a build's draft head comes from: `head` "auto" (the head shipped for this checkpoint, if any), "none",
    a train-draft folder (head.safetensors) or the file itself. Returns (file or None, what it is)."""
    from spork_trt.spec.draft_head import HEAD_FILE

    if head == "none":
        return None, "none"
    if head == "auto":
        found = shipped(source_sha256)
        if found is not None and (found / HEAD_FILE).is_file():
            return found / HEAD_FILE, f"shipped {found.name}"
        return None, "none (no head shipped for this checkpoint)"
    p = Path(head)
    if (p / HEAD_FILE).is_file():
        return p / HEAD_FILE, str(p)
    if p.is_file():
        return p, str(p)
    raise UserError(f"--head {head}: use auto, none, a `python -m export train-draft` folder (with {HEAD_FILE}) or "
                    "the file")


def text_file(folder: Path) -> Path:
    """The file a store is built from: corpus.npz, else answers.jsonl."""
    return folder / CORPUS if (folder / CORPUS).is_file() else folder / ANSWERS


def build_store(folder: Path, out: Path) -> Datastore:
    """The memory-mapped datastore in `out`, from a packed or self-data folder."""
    tokens = load_corpus(folder) if (folder / CORPUS).is_file() else join(corpus_sequences(folder))
    store = Datastore.index(tokens)
    store.save(out)
    return store
