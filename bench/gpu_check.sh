#!/usr/bin/env bash
# The GPU engine's check on a lent GPU machine (the device tool: nothing to fetch there, 64 MiB per call, 15 minutes
# a session). Prepared and self-checked on the CPU; run on an H200 in two sessions on 2026-12-04 (docs/engines.md).
#
#   here:      bash bench/gpu_check.sh prepare     # fills .gpu/ (git-ignored through .git/info/exclude): the default
#                                                   # GGUF in two parts, the gguf wheel, 16 MT-bench prompts as JSONL
#   device 1:  bash bench/gpu_check.sh stage       # carry [".gpu/part1"]: copies part 1 to /root (a short call)
#   device 2:  bash bench/gpu_check.sh run         # at once (the machine stays warm 30 s), carry [".gpu/part2",
#                                                   # ".gpu/wheels", ".gpu/prompts"]: joins the GGUF, checks its
#                                                   # sha256, runs `python -m bench gpu`, writes $OUT/gpu_check.json
#                                                   # (DTYPE=bf16|fp16|fp32, default fp32; PROMPTS=mt_bench|humaneval)
#   or:        bash bench/gpu_check.sh profile     # carry as for run: `bench gpu --profile` (the forward's cost by
#                                                   # tokens, the store arm, torch.profiler and cProfile tables);
#                                                   # PROMPTS=humaneval for the first 16 HumanEval prompts
#   or:        bash bench/gpu_check.sh all         # carry as for run, about 7 minutes: run, then profile on MT-bench and on
#                                                   # HumanEval, into $OUT/{run,mt,he} (6 files: the device tool
#                                                   # brings back 8 at most), then one summary line per arm
#   or, for the learned drafts (instead of run: 15 device minutes hold one of the two):
#   device 2:  bash bench/gpu_check.sh data        # carry as for run: joins the GGUF, then the self-data at GPU scale
#                                                   # (`export self-data --device cuda`, 128 slots, resumable; stops at
#                                                   # 4 minutes, keeping what it wrote)
#   device 3:  bash bench/gpu_check.sh train       # at once, carry nothing: `export train-draft --device cuda` on it
#                                                   # (stops at 6 minutes, saving its last epoch), then copies the head,
#                                                   # its report and the data (packed when finished) to $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
step="${1:-}"

join_and_install() {  # on the device: the GGUF from its two carried parts (sha256 checked), the carried wheels
    cat /root/model.gguf.aa .gpu/part2/model.gguf.ab > /root/model.gguf
    echo "$(cat .gpu/part2/sha256)  /root/model.gguf" | sha256sum -c -
    python3 -m pip install --quiet --no-deps --no-index --target /root/pylib .gpu/wheels/*.whl
    export PYTHONPATH="$PWD:/root/pylib" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
}

case "$step" in
prepare)
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    rm -rf .gpu && mkdir -p .gpu/part1 .gpu/part2 .gpu/wheels .gpu/prompts
    gguf=$(.venv/bin/python -c 'from spork_trt.checkpoint.weights import default_gguf_path; print(default_gguf_path())')
    sha256sum "$gguf" | cut -d' ' -f1 > .gpu/part2/sha256
    split -b 50000000 "$gguf" .gpu/model.gguf.
    mv .gpu/model.gguf.aa .gpu/part1/ && mv .gpu/model.gguf.ab .gpu/part2/
    .venv/bin/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 -d .gpu/wheels \
        "gguf==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("gguf"))')"
    .venv/bin/python - <<'EOF'
import json
from spork_trt.prompts import load_prompts
for name in ("mt_bench", "humaneval"):
    with open(f".gpu/prompts/{name}16.jsonl", "w") as f:
        for r in load_prompts(name, 16):
            f.write(json.dumps({"question_id": r["id"], "category": r["category"], "turns": [r["prompt"]]}) + "\n")
EOF
    du -sh .gpu/*
    ;;
stage)
    cp .gpu/part1/model.gguf.aa /root/model.gguf.aa
    ls -l /root/model.gguf.aa
    ;;
run)
    join_and_install
    timeout 460 python3 -m bench gpu --model /root/model.gguf --prompts ".gpu/prompts/${PROMPTS:-mt_bench}16.jsonl" \
        --limit 16 --max-new-tokens 128 --batch 32 --dtype "${DTYPE:-fp32}" --out "${OUT:-results/gpu}"
    ;;
profile)
    join_and_install
    timeout 300 python3 -m bench gpu --profile --model /root/model.gguf --prompts ".gpu/prompts/${PROMPTS:-mt_bench}16.jsonl" \
        --limit 16 --max-new-tokens 128 --dtype "${DTYPE:-fp32}" --out "${OUT:-results/gpu}"
    ;;
all)
    base="${OUT:-results/gpu}"
    OUT="$base/run" bash "$0" run > /dev/null || echo "run failed (rc $?)"
    OUT="$base/mt" bash "$0" profile > /dev/null || echo "profile MT-bench failed (rc $?)"
    OUT="$base/he" PROMPTS=humaneval bash "$0" profile > /dev/null || echo "profile HumanEval failed (rc $?)"
    rm -f "$base"/he/profile_*.txt
    python3 bench/gpu_summary.py "$base"/run "$base"/mt "$base"/he
    ;;
data)
    join_and_install
    timeout 240 python3 -m export self-data --device cuda --dtype bf16 --model /root/model.gguf --slots 128 \
        --magpie 4000 --openers 4000 --stdlib 1400 --out /root/selfdata || echo "self-data stopped (rc $?): training on what it wrote"
    wc -l /root/selfdata/*.jsonl
    ;;
train)
    export PYTHONPATH="$PWD:/root/pylib" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
    out="${OUT:-results/gpu}"
    mkdir -p "$out"
    args=(--device cuda --model /root/model.gguf --data /root/selfdata --steps 3 --out /root/head)
    if ! timeout 360 python3 -m export train-draft "${args[@]}" --epochs 8; then
        done=$(python3 -c 'import json; print(json.load(open("/root/head/checkpoint/state.json"))["epoch"])' \
            2>/dev/null || echo 0)
        echo "train-draft stopped after epoch $done: saving that head"
        if [ "$done" -gt 0 ]; then python3 -m export train-draft "${args[@]}" --epochs "$done" --resume; fi
    fi
    cp /root/head/head.safetensors /root/head/report.json "$out"/ || true
    if [ -f /root/selfdata/recipe.json ]; then
        python3 -m export pack --data /root/selfdata --out "$out/corpus"
    else
        gzip -c /root/selfdata/answers.jsonl > "$out/answers.jsonl.gz"
    fi
    ls -l "$out"
    ;;
*)
    echo "usage: bash bench/gpu_check.sh prepare|stage|run|profile|all|data|train (see the comments at the top)" >&2
    exit 2
    ;;
esac
