"""One line per arm of `bench gpu` results (gpu_check.json in each folder given), for a device call's short output:
`python3 bench/gpu_summary.py DIR ...` (bench/gpu_check.sh all)."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def lines(folder: Path) -> list[str]:
    path = folder / "gpu_check.json"
    if not path.is_file():
        return [f"{folder.name}: no gpu_check.json"]
    res = json.loads(path.read_text())
    out = [f"{folder.name}: plain {res['plain']['tokens_per_s']} tok/s, step {res['plain']['step_ms']} ms"]
    for name, arm in res.get("spork", {}).items():
        out.append(f"{folder.name}: spork/{name} {arm['tokens_per_s']} tok/s, {arm['x_plain']}x plain, "
                   f"{arm['tokens_per_step']} tok/step, {arm['mismatches']} mismatches")
    if "batched" in res:
        b = res["batched"]
        out.append(f"{folder.name}: batched {b['tokens_per_s']} tok/s, {b['x_batch_1']}x batch 1, "
                   f"{b['identical_to_batch_1']} identical")
    if "forward" in res:
        out.append(f"{folder.name}: forward ms by T " + " ".join(
            f"{t}:{f['call_ms']}@{f['bucket']}" for t, f in res["forward"].items()))
    return out


def main(folders: list[str]) -> int:
    for f in folders:
        print("\n".join(lines(Path(f))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
