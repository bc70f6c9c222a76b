"""The serving image `export k8s` manifests name (Dockerfile, docker/install.sh, `make image`): parsed with the
`dockerfile` package (the Go parser Docker itself uses) and checked against the manifests; its install steps run
here (pip resolving every pin, both kernel flavours compiled, loaded by a process with no compiler). No Docker
engine runs on these machines: building the image itself is unverified (docs/support.md)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spork_trt.serving.k8s import PORTS, RUN_AS_USER, K8sConfig, serve_command

ROOT = Path(__file__).resolve().parents[1]


def stages() -> list[list]:
    """The Dockerfile's instructions, one list per stage (each starting at its FROM)."""
    import dockerfile

    out: list[list] = []
    for c in dockerfile.parse_file(str(ROOT / "Dockerfile")):
        if c.cmd == "FROM":
            out.append([])
        if out:
            out[-1].append(c)
    return out


def values(stage: list, cmd: str) -> list[tuple[str, ...]]:
    return [c.value for c in stage if c.cmd == cmd.upper()]


def test_two_stages_and_the_last_runs_the_manifests_command_as_their_user_without_a_compiler():
    build, final = stages()
    assert values(build, "from")[0][1:] == ("AS", "build")
    command = serve_command(K8sConfig(), "/engines/triton_repo")  # the Deployment's (k8s.deployment), no build read
    assert values(final, "user")[-1] == (str(RUN_AS_USER),) and RUN_AS_USER != 0  # non-root, the pod's user
    assert not any(tool in " ".join(v[0] for v in values(final, "run")) for tool in ("g++", "gcc", "clang"))
    assert any("sh docker/install.sh" in v[0] for v in values(build, "run"))
    copied = [(c.flags, c.value) for c in final if c.cmd == "COPY"]
    assert all("--from=build" in flags for flags, _ in copied)
    assert {v[-1] for _, v in copied} == {"/opt/spork", "/engines"}
    env = {st: dict(zip(v[::2], v[1::2])) for st in ("build", "final") for v in
           values(build if st == "build" else final, "env")}
    assert env["build"]["TORCH_EXTENSIONS_DIR"] == env["final"]["TORCH_EXTENSIONS_DIR"]  # the prebuilt kernels
    assert sorted(int(p) for v in values(final, "expose") for p in v) == sorted(PORTS.values())
    cmd = values(final, "cmd")[-1]
    assert cmd[:4] == tuple(command[:4]) and cmd[cmd.index("--repo") + 1] == command[command.index("--repo") + 1]


def test_every_path_the_build_stage_copies_is_in_the_checkout_and_in_the_context():
    build, _ = stages()
    ignored = (ROOT / ".dockerignore").read_text().split()
    for v in values(build, "copy"):
        for src in v[:-1]:
            assert (ROOT / src).exists(), src
            assert src.split("/")[0] not in ignored, src


def test_make_image_tags_the_image_the_manifests_name():
    make = subprocess.run(["make", "-n", "image"], cwd=ROOT, capture_output=True, text=True)
    assert make.returncode == 0, make.stderr
    assert f"docker build -t {K8sConfig().image} ." in make.stdout
    version = next(line.split('"')[1] for line in (ROOT / "pyproject.toml").read_text().splitlines()
                   if line.startswith("version"))
    assert K8sConfig().image == f"spork-trt:{version}"


@pytest.mark.slow
def test_the_install_steps_resolve_every_pin_and_leave_kernels_a_process_without_a_compiler_loads(tmp_path):
    """docker/install.sh --dry-run: a fresh venv, pip resolving requirements.txt, requirements-nodeps.txt and the
    project against the index (nothing installed), both flavours compiled; then a process with no compiler and no
    ninja on its PATH loads this CPU's flavour from them."""
    from spork_trt.engines.cpu import kernels

    ext = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}  # this CPU's flavour is built there already
    venv = tmp_path / "venv"
    r = subprocess.run(["sh", str(ROOT / "docker" / "install.sh"), str(venv), "--dry-run", "--python",
                        sys.executable], env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Would install" in r.stdout and "torch-2.13.0" in r.stdout  # resolved, not installed
    assert not list(venv.glob("lib/python*/site-packages/torch"))
    for fl in kernels.FLAVORS.values():
        d = kernels.build_directory(fl)
        assert d.parent == ext and (d / kernels.BUILT).is_file() and (d / f"{kernels.library(fl)}.so").is_file()
    if kernels.flavor() is None:
        pytest.skip("this CPU runs neither flavour")
    bare = {"TORCH_EXTENSIONS_DIR": str(ext), "PATH": "/nonexistent", "CXX": "/bin/false", "HOME": str(tmp_path)}
    probe = subprocess.run([sys.executable, "-c", "from spork_trt.engines.cpu import kernels as k; "
                            "print(k.kernel(), k.arithmetic())"], env=bare, capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split()[0] == "spork" and "unavailable" not in probe.stderr, probe.stderr
