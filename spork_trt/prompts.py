"""Prompt sets for benchmarks and calibration: spork_trt/data (MT-bench first turns, HumanEval prompts, each with its
license; shipped in the package), long
inputs made from Python's own documentation (`long_docs`, and `rag_mix`: MT-bench with every third prompt a long
one), or any FastChat-style JSONL."""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

from spork_trt.errors import UserError

DATA = Path(__file__).resolve().parent / "data"  # shipped with the package (pyproject's package-data)


def data_file(*parts: str) -> Path:
    """A shipped prompt file, or one clear line saying how to get it back."""
    path = DATA.joinpath(*parts)
    if not path.is_file():
        raise UserError(f"prompt data {path} is missing: it ships with spork_trt (restore it with `git checkout -- "
                        f"spork_trt/data` or reinstall the package)")
    return path


def load_prompts(name: str, limit: int | None = None) -> list[dict]:
    """[{"id", "category", "prompt"}] for "mt_bench", "humaneval", "long_docs", "rag_mix", "json_extract" (each row
    also has "schema": the JSON schema its answer must match) or a JSONL path with `turns`."""
    if name == "mt_bench":
        rows = read_jsonl(data_file("mt_bench", "question.jsonl"))
        out = [{"id": r["question_id"], "category": r["category"], "prompt": r["turns"][0]} for r in rows]
    elif name == "long_docs":
        out = long_docs()
    elif name == "rag_mix":
        out = rag_mix(load_prompts("mt_bench"), long_docs())
    elif name == "json_extract":
        out = json_extract(load_prompts("humaneval"))
    elif name == "humaneval":
        with gzip.open(data_file("humaneval", "HumanEval.jsonl.gz"), "rt") as fh:
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
        raise UserError(f"prompt file {path} not found: use mt_bench, humaneval, long_docs, rag_mix, json_extract or a "
                        "JSONL path")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


EXTRACT_TASK = ("Read the Python function below and answer with JSON only: its name, its parameter names, what it "
                "returns (a few words), and each example call in its docstring with the result it shows.\n\n")
EXTRACT_SCHEMA = {  # a field extraction users run with response_format; its keys and punctuation are forced tokens
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
        "parameters": {"type": "array", "items": {"type": "string"}, "maxItems": 6},
        "returns": {"type": "string"},
        "examples": {"type": "array", "maxItems": 4, "items": {
            "type": "object", "properties": {"call": {"type": "string"}, "result": {"type": "string"}},
            "required": ["call", "result"], "additionalProperties": False}},
    },
    "required": ["name", "parameters", "returns", "examples"],
    "additionalProperties": False,
}


def json_extract(humaneval: list[dict]) -> list[dict]:
    """Structured extraction over HumanEval's functions: each prompt asks for the function's name, parameters,
    return and docstring examples as JSON matching EXTRACT_SCHEMA (`bench run --response-format json_schema`)."""
    prefix = "Complete the following Python function:\n"
    schema = json.dumps(EXTRACT_SCHEMA)
    return [{"id": f"extract-{r['id']}", "category": "json_extract",
             "prompt": EXTRACT_TASK + r["prompt"][len(prefix):], "schema": schema} for r in humaneval]


LONG_CHARS = (3200, 6000)  # a long prompt's document: about 700 to 1,500 tokens of the default model
LONG_TASKS = ("Summarize the following section of the Python documentation in three sentences.\n\n{doc}",
              "Using only the documentation below, explain what it says about {topic}, with one short example."
              "\n\nDocumentation:\n{doc}")


def long_docs() -> list[dict]:
    """Summarization and RAG-style prompts over windows of Python's language reference (pydoc_data.topics, the text
    `help()` shows; no learned artifact draws on it), the two tasks alternating; each window is whole paragraphs of
    one topic, LONG_CHARS long. The set follows the Python version's documentation."""
    from pydoc_data.topics import topics

    out = []
    for topic in sorted(topics):
        doc = ""
        for para in re.split(r"\n\s*\n", topics[topic]):
            doc = f"{doc}\n\n{para.strip()}" if doc else para.strip()
            if len(doc) >= LONG_CHARS[0]:
                task = LONG_TASKS[len(out) % len(LONG_TASKS)]
                out.append({"id": f"{topic}-{len(out)}", "category": "long",
                            "prompt": task.format(doc=doc[:LONG_CHARS[1]], topic=topic.replace("-", " "))})
                doc = ""
    return out


def rag_mix(short: list[dict], long: list[dict]) -> list[dict]:
    """`short` with every third prompt taken from `long` in order (a serving mix where a third of the inputs are
    long documents), as long as both last."""
    out, s, g = [], iter(short), iter(long)
    for k in range(len(short) + len(long)):
        row = next(g if k % 3 == 2 else s, None)
        if row is None:
            break
        out.append(row)
    return out
