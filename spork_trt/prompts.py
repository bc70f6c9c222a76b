"""Prompt sets for benchmarks and calibration: ../shared/data (MT-bench first turns, HumanEval prompts) or any
FastChat-style JSONL."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from .errors import UserError

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def load_prompts(name: str, limit: int | None = None) -> list[dict]:
    """[{"id", "category", "prompt"}] for "mt_bench", "humaneval" or a JSONL path with `turns`."""
    if name == "mt_bench":
        rows = read_jsonl(DATA / "mt_bench" / "question.jsonl")
        out = [{"id": r["question_id"], "category": r["category"], "prompt": r["turns"][0]} for r in rows]
    elif name == "humaneval":
        with gzip.open(DATA / "humaneval" / "HumanEval.jsonl.gz", "rt") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        out = [{"id": r["task_id"], "category": "coding",
                "prompt": "Complete the following Python function:\n" + r["prompt"]} for r in rows]
    else:
        rows = read_jsonl(Path(name))
        out = [{"id": r.get("question_id", i), "category": r.get("category", "custom"), "prompt": r["turns"][0]}
               for i, r in enumerate(rows)]
    return out[:limit] if limit else out


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise UserError(f"prompt file {path} not found: use mt_bench, humaneval or a JSONL path")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
