"""Function-completion prompts from this Python's standard library (PSF license): a signature and its docstring,
"Complete the following Python function". Never benchmark text: static quantization calibrates on them
(calib_data.py) and self-data asks the target to answer them (learn/selfdata.py), each in its own seeded order."""
from __future__ import annotations

import ast
import functools
import random
import sysconfig
from pathlib import Path

CODE_PREFIX = "Complete the following Python function:\n"


def stdlib_candidates(seed: int) -> list[dict]:
    """Every public top-level documented function of this Python's standard library as a prompt {"id", "prompt"}
    (signature + docstring), in one order shuffled with `seed`."""
    found = list(stdlib_prompts())
    random.Random(seed).shuffle(found)
    return found


@functools.cache
def stdlib_prompts() -> tuple[dict, ...]:
    """stdlib_candidates' prompts in file order (parsing the standard library takes seconds: once)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}
    found = []
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and ast.get_docstring(node) \
                    and node.body and len(node.body) > 1 and node.col_offset == 0:
                doc = node.body[0]
                head = "\n".join(lines[node.lineno - 1:doc.end_lineno])
                found.append({"id": f"stdlib:{path.relative_to(root)}:{node.name}", "prompt": CODE_PREFIX + head})
    return tuple({f["id"]: f for f in found}.values())  # a function defined twice in one module: once
