"""Kubernetes manifests for a real build, validated offline: `kubectl kustomize` renders the base and both overlays,
every object passes kubernetes-validate's schemas (strict: no unknown field), yamllint passes, and the figures in
them follow the build and the server (memory from the manifest, grace period from the drain, the gauges the spork
model exports)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from spork_trt.errors import UserError
from spork_trt.serving.k8s import ACTIVE_GAUGE, QUEUE_GAUGE, K8sConfig, memory_request, render

K8S_VERSION = "1.32.0"  # the schemas checked against (kubectl on these machines is 1.32)
ROOT = Path(__file__).resolve().parents[1]


def kustomize(folder: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render kustomizations (apt: kubectl; it ships kustomize)"
    out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.slow
def test_manifests_render_and_validate_offline(default_engines, tmp_path):
    import kubernetes_validate

    cfg = K8sConfig(engines=default_engines, out=tmp_path / "deploy", namespace="llm", drain_s=45, replicas=2)
    render(cfg)
    lint = subprocess.run([sys.executable, "-m", "yamllint", "-s", "-d",
                           "{extends: default, rules: {line-length: {max: 120}}}", str(cfg.out)],
                          capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    rendered = {name: kustomize(cfg.out / sub) for name, sub in
                (("base", "base"), ("cpu", "overlays/cpu"), ("gpu", "overlays/gpu"))}
    for name, docs in rendered.items():
        assert sorted(d["kind"] for d in docs) == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler",
                                                   "PodDisruptionBudget", "Service"], name
        for d in docs:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)  # raises on any schema error
            assert d["metadata"]["namespace"] == "llm"
    by_kind = {name: {d["kind"]: d for d in docs} for name, docs in rendered.items()}
    dep = by_kind["base"]["Deployment"]["spec"]
    pod = dep["template"]["spec"]
    c = pod["containers"][0]
    assert dep["replicas"] == 2 and pod["terminationGracePeriodSeconds"] > 45
    assert c["command"][c["command"].index("--drain-timeout") + 1] == "45"
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    key = {e["name"]: e for e in c["env"]}["SPORK_API_KEY"]  # the OpenAI API's key from a Secret, never a literal
    assert key["valueFrom"]["secretKeyRef"] == {"name": "spork-api-key", "key": "api-key"} and "value" not in key
    assert c["resources"]["requests"]["memory"] == f"{-(-memory_request(cfg) // (1 << 20))}Mi"
    assert memory_request(cfg) > sum(p.stat().st_size for p in default_engines.glob("*.onnx*"))
    hpa = by_kind["base"]["HorizontalPodAutoscaler"]["spec"]
    assert [m["pods"]["metric"]["name"] for m in hpa["metrics"]] == [QUEUE_GAUGE, ACTIVE_GAUGE]
    exported = (ROOT / "spork_trt" / "serving" / "triton_models" / "spork" / "model.py").read_text()
    assert f'"{QUEUE_GAUGE}"' in exported and f'"{ACTIVE_GAUGE}"' in exported  # the spork model's own gauges
    rules = yaml.safe_load(by_kind["base"]["ConfigMap"]["data"]["config.yaml"])["rules"]
    assert [r["name"]["as"] for r in rules] == [QUEUE_GAUGE, ACTIVE_GAUGE]
    gpu = by_kind["gpu"]["Deployment"]["spec"]["template"]["spec"]
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "/engines/triton_gpu" in gpu["containers"][0]["command"]
    cpu = by_kind["cpu"]["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert cpu["resources"]["requests"]["cpu"] == "2" and "memory" in cpu["resources"]["requests"]


@pytest.mark.parametrize("over, field", [({"namespace": "Bad_NS"}, "namespace"), ({"replicas": 0}, "replicas"),
                                         ({"drain_s": 0}, "drain_s"), ({"image": "a b"}, "image"),
                                         ({"replicas": 9, "max_replicas": 8}, "replicas")])
def test_bad_settings_name_the_field(over, field):
    with pytest.raises(UserError, match=f"^{field} must"):
        K8sConfig(**over)
