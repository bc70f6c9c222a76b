"""Atomic artifacts: a file (spork_trt/atomic.py) or a whole build (export build) appears whole or not at all, and a
build whose files do not match its manifest is refused wherever it is loaded (manifest.read), on tiny builds."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spork_trt import atomic
from spork_trt.checkpoint import manifest as mf
from spork_trt.errors import UserError
from spork_trt.export import build as build_mod
from spork_trt.export.build import BuildConfig, build
from spork_trt.loop.runtime import Runtime
from spork_trt.checkpoint.tokenizer import load_tokenizer
from spork_trt.serving.triton_repo import RepoConfig, ensure_rendered
from spork_trt.checkpoint.weights import default_gguf_path
from tests.test_weights import hf_tiny

FIX = r"rebuild with `python -m export build --out .* --force`"


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint (Hugging Face folder) with the default model's tokenizer files."""
    _, hf = hf_tiny(tmp_path_factory.mktemp("tiny"))
    load_tokenizer(default_gguf_path(), "gguf").save(hf)
    return hf


def tiny_build(source: Path, out: Path, **over) -> Path:
    """About a second: the fp32 target and a 1-layer verifier, no drafts, datastore or head."""
    cfg = dict(model=str(source), out=out, drafts=(), store="none", head="none", verifier_layers=1) | over
    return build(BuildConfig(**cfg))


@pytest.fixture
def built(tiny_source, tmp_path) -> Path:
    return tiny_build(tiny_source, tmp_path / "eng")


def contents(d: Path) -> dict[str, str]:
    """Every file under `d` (relative name -> sha256)."""
    return {str(p.relative_to(d)): mf.sha256(p) for p in sorted(d.rglob("*")) if p.is_file()}


def hidden(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if p.name.startswith(".")]


# the helper


def test_a_writer_that_raises_leaves_the_old_file_and_no_partial_one(tmp_path):
    dest = tmp_path / "results.jsonl"
    atomic.write_text(dest, "old\n")
    with pytest.raises(RuntimeError), atomic.open(dest) as fh:
        fh.write("half a rec")
        raise RuntimeError("killed mid-write")
    assert dest.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["results.jsonl"]
    with pytest.raises(RuntimeError), atomic.path(tmp_path / "new.npy") as tmp:
        tmp.write_bytes(b"partial")
        raise RuntimeError
    assert [p.name for p in tmp_path.iterdir()] == ["results.jsonl"]
    atomic.write_bytes(dest, b"new\n")
    assert dest.read_bytes() == b"new\n" and [p.name for p in tmp_path.iterdir()] == ["results.jsonl"]


def test_a_folder_is_replaced_whole_and_left_as_it_was_when_the_writer_raises(tmp_path):
    dest = tmp_path / "cache"
    with atomic.folder(dest) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError), atomic.folder(dest) as tmp:
        (tmp / "a").write_text("2")
        raise RuntimeError
    assert contents(dest) == {"a": mf.sha256(dest / "a")} and (dest / "a").read_text() == "1"
    with atomic.folder(dest) as tmp:
        (tmp / "b").write_text("3")
    assert sorted(contents(dest)) == ["b"] and hidden(tmp_path) == []


# a half build is refused


def truncate(d: Path) -> None:
    p = d / "target.onnx.data"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def tear_manifest(d: Path) -> None:
    p = d / mf.MANIFEST
    p.write_text(p.read_text()[:200])


@pytest.mark.parametrize("damage", [truncate, tear_manifest, lambda d: (d / "verifier.onnx").unlink(),
                                    lambda d: (d / mf.MANIFEST).unlink()],
                         ids=["truncated-artifact", "torn-manifest", "missing-file", "missing-manifest"])
def test_a_half_build_is_refused_naming_the_fix(built, damage):
    Runtime.from_engines(built)  # whole: loads
    damage(built)
    with pytest.raises(UserError, match=FIX):
        Runtime.from_engines(built)
    with pytest.raises(UserError, match=FIX):  # `serve`: its repository is rendered and current, still checked
        ensure_rendered(RepoConfig(built))


def test_verify_catches_a_same_size_change(built):
    p = built / "target.onnx.data"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))
    Runtime.from_engines(built)  # sizes match: the cheap check passes
    with pytest.raises(UserError, match="sha256.*" + FIX):
        Runtime.from_engines(built, verify=True)
    with pytest.raises(UserError, match="sha256.*" + FIX):  # `serve --verify`
        ensure_rendered(RepoConfig(built), verify=True)
    r = subprocess.run([sys.executable, "-m", "spork_trt", "generate", "hi", "--engines", str(built), "--verify"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--force" in r.stderr and "Traceback" not in r.stderr


# a build that fails or is killed leaves the previous one


def boom(*_, **__):
    raise RuntimeError("the build failed here")


@pytest.mark.parametrize("stage", ["verifier", "manifest"])
def test_a_failed_build_leaves_the_previous_one_whole(built, tiny_source, monkeypatch, stage):
    before = contents(built)
    real = build_mod.export_onnx
    if stage == "verifier":  # after the new target graphs are written
        monkeypatch.setattr(build_mod, "export_onnx", lambda m, out, **kw: real(m, out, **kw) if "target" in out.name
                            else boom())
    else:  # every new artifact written, the manifest not yet
        monkeypatch.setattr(mf, "write", boom)
    with pytest.raises(RuntimeError, match="failed here"):
        tiny_build(tiny_source, built, precision="int8", force=True)  # other graphs than the previous build's
    assert contents(built) == before and hidden(built.parent) == []
    Runtime.from_engines(built, verify=True)


def test_a_killed_build_leaves_the_previous_one_and_its_leftovers_are_swept(built, tiny_source):
    before = contents(built)
    script = (f"import time; from spork_trt.export import build as b; real = b.export_onnx\n"
              f"def slow(*a, **k):\n    out = real(*a, **k); time.sleep(600); return out\n"
              f"b.export_onnx = slow\n"
              f"b.build(b.BuildConfig(model={str(tiny_source)!r}, out=b.Path({str(built)!r}), drafts=(), "
              f"store='none', head='none', verifier_layers=1, precision='int8', force=True))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[1],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not any((built.parent / h / "target_fp32.onnx").is_file() for h in hidden(built.parent)):
            assert proc.poll() is None and time.monotonic() < deadline, "the build did not get to its first graph"
            time.sleep(0.2)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert contents(built) == before  # killed mid-build: the previous build, untouched
    Runtime.from_engines(built, verify=True)
    assert hidden(built.parent)  # the killed build's folder, at a hidden name nothing loads
    tiny_build(tiny_source, built, precision="int8", force=True)
    assert hidden(built.parent) == [] and mf.read(built)["build_inputs"]["precision"] == "int8"


def test_a_rebuild_keeps_what_the_user_made_and_drops_what_it_no_longer_builds(tiny_source, tmp_path):
    out = tiny_build(tiny_source, tmp_path / "eng", drafts=("self-int8",))
    (out / "calibration").mkdir()
    (out / "calibration" / "nodes.npz").write_bytes(b"cached")
    (out / "confidence_head-ngram.json").write_text("{}")
    (out / "NOTES.txt").write_text("mine")
    tiny_build(tiny_source, out, force=True)
    assert (out / "calibration" / "nodes.npz").read_bytes() == b"cached"
    assert (out / "confidence_head-ngram.json").read_text() == "{}" and (out / "NOTES.txt").read_text() == "mine"
    assert (out / "triton_repo" / "ensemble" / "config.pbtxt").is_file()
    m = json.loads((out / mf.MANIFEST).read_text())
    assert not (out / "draft_int8.onnx").exists() and "draft_int8.onnx" not in m["artifacts"]
    assert "confidence_head-ngram.json" not in m["artifacts"]  # recalibrating never breaks the build's manifest
    tiny_build(tiny_source, out)  # up to date: reused as it is
    assert contents(out)["target.onnx"] == mf.sha256(out / "target.onnx") and hidden(tmp_path) == []


def test_a_folder_is_replaced_where_the_filesystem_cannot_exchange_names(tmp_path, monkeypatch):
    """Without renameat2 (another OS, an old libc): two renames, the same result."""
    monkeypatch.setattr(atomic.ctypes, "CDLL", lambda *a, **k: object())
    dest = tmp_path / "cache"
    for text in ("1", "2"):
        with atomic.folder(dest) as tmp:
            (tmp / "a").write_text(text)
    assert (dest / "a").read_text() == "2" and hidden(tmp_path) == []


def test_a_folder_that_is_not_a_build_is_refused_and_nothing_in_it_is_lost(tiny_source, tmp_path):
    """`--out .` in a repository: its README, .git/ and .venv/ survive a refused build and a forced one."""
    repo = tmp_path / "repo"
    (repo / ".git" / "objects").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / ".venv" / "bin" / "python").write_text("#!")
    (repo / "README.md").write_text("mine")
    (repo / ".env").write_text("KEY=1")
    before = contents(repo)
    with pytest.raises(UserError, match=r"is not a build .*holds 4 entries .*\.git/.*README\.md.*--force"):
        tiny_build(tiny_source, repo)
    assert contents(repo) == before
    tiny_build(tiny_source, repo, force=True)
    after = contents(repo)
    assert {k: after[k] for k in before} == before and (repo / mf.MANIFEST).is_file()
    assert hidden(tmp_path) == []
    tiny_build(tiny_source, repo, force=True, drafts=("self-int8",))  # a rebuild keeps them too, dot-files included
    after = contents(repo)
    assert {k: after[k] for k in before} == before and "draft_int8.onnx" in after


def test_a_file_as_the_output_folder_is_refused(tiny_source, tmp_path):
    (tmp_path / "eng").write_text("mine")
    with pytest.raises(UserError, match="is a file, not a folder"):
        tiny_build(tiny_source, tmp_path / "eng", force=True)
    assert (tmp_path / "eng").read_text() == "mine"


def test_temporary_names_are_told_from_dot_files():
    assert atomic.is_temp(atomic.temp_name(Path("x/target.onnx")).name)
    assert atomic.is_temp(atomic.temp_name(Path("eng"), "old").name)
    assert not any(atomic.is_temp(n) for n in (".git", ".venv", ".env", ".config.1.bak"))
