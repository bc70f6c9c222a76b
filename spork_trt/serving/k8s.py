"""Kustomize manifests for a built, rendered repository: Triton on Kubernetes, scaled on the spork queue.

    OUT/base/        Deployment (startup, readiness, liveness probes on Triton's health endpoints; the drain as
                     terminationGracePeriodSeconds), Service (http, grpc, metrics), PodDisruptionBudget,
                     HorizontalPodAutoscaler on spork_queued_requests and spork_active_requests (per pod),
                     the prometheus-adapter rules that turn those gauges into custom metrics
    OUT/overlays/cpu the CPU profile: two cores per spork instance (the memory request, from the build, is in base)
    OUT/overlays/gpu one nvidia.com/gpu per pod, the repository rendered with --profile gpu

The image is the operator's: it holds this project installed and the engines folder at /engines (docs/serving.md
"Kubernetes" has a Dockerfile sketch); the pod runs `python -m spork_trt serve --host 0.0.0.0`, whose SIGTERM drain
is Kubernetes' termination. Everything is written with PyYAML and validated in tests with `kubectl kustomize`,
kubernetes-validate and yamllint.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from spork_trt import atomic
from spork_trt.errors import UserError

NAME = "spork-trt"
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002, "openai": 9000}  # serve --openai-port: 9000 by default
GIB = 1 << 30
BASE_MEMORY = 2 * GIB  # tritonserver, its python stubs, the tokenizer: measured RSS of an idle default server ~1.6 GiB
QUEUE_GAUGE, ACTIVE_GAUGE = "spork_queued_requests", "spork_active_requests"  # spork_trt/serving/triton_models/spork/model.py
API_KEY_SECRET = ("spork-api-key", "api-key")  # the Secret (name, key) the OpenAI API's key comes from
RUN_AS_USER = 1000  # the pod's non-root user: the image (Dockerfile) runs as it too
SCRATCH = "/scratch"  # an emptyDir: the server log and the python backend's cache (the image may be read-only)


@dataclass(frozen=True)
class K8sConfig:
    engines: Path = Path("engines/default")
    out: Path = Path("deploy")
    image: str = "spork-trt:0.1.0"
    namespace: str = ""  # "": the namespace kubectl applies to
    replicas: int = 1
    max_replicas: int = 8
    drain_s: int = 30  # serve --drain-timeout; the pod's grace period adds a margin
    queue_target: int = 4  # HPA: queued requests per pod above which it scales out

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.namespace or "a"):
            raise UserError(f"namespace must be a DNS label (lowercase letters, digits, '-'), got {self.namespace!r}")
        if not 1 <= self.replicas <= self.max_replicas:
            raise UserError(f"replicas must be in 1..max_replicas ({self.max_replicas}), got {self.replicas}")
        for field in ("drain_s", "queue_target"):
            if getattr(self, field) < 1:
                raise UserError(f"{field} must be >= 1, got {getattr(self, field)}")
        if not self.image or any(c.isspace() for c in self.image):
            raise UserError(f"image must be an image reference without spaces, got {self.image!r}")


def dump(doc: dict) -> str:
    """YAML as kubectl and yamllint's default rules write it: lists indented under their key."""
    import yaml

    class Indented(yaml.SafeDumper):
        def increase_indent(self, flow: bool = False, indentless: bool = False):
            return super().increase_indent(flow, False)

    return yaml.dump(doc, Dumper=Indented, sort_keys=False)


@dataclass(frozen=True)
class Served:
    """What the rendered repository serves per pod: the spork model's instances, and each one's KV pool."""
    instances: int
    slots: int
    max_len: int  # rows per slot


def served(engines: Path) -> Served:
    from spork_trt.serving.triton_repo import spork_model

    m = spork_model(engines / "triton_repo")
    return Served(m.instances, int(m.params["slots"]), int(m.params["max_len"]))


def memory_request(cfg: K8sConfig) -> int:
    """Bytes a pod needs, estimated from the build and its repository: every artifact loaded once per spork
    instance, plus each instance's fp32 KV pool (slots x rows x layers x K and V), plus the server's own share."""
    from spork_trt.checkpoint import manifest as mf

    m, s = mf.read(cfg.engines), served(cfg.engines)
    model = mf.spec_config(m["model"])
    artifacts = sum(a.get("bytes", 0) for a in m["artifacts"].values())
    kv = s.slots * s.max_len * model.n_layers * 2 * model.n_kv_heads * (model.dim // model.n_heads) * 4
    return BASE_MEMORY + s.instances * (artifacts + kv)


def serve_command(cfg: K8sConfig, repo: str) -> list[str]:
    return ["python", "-m", "spork_trt", "serve", "--host", "0.0.0.0", "--repo", repo, "--drain-timeout",
            str(cfg.drain_s), "--log", f"{SCRATCH}/tritonserver.log"]


def deployment(cfg: K8sConfig) -> dict:
    def probe(path: str, period: int, failures: int) -> dict:
        return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures,
                "timeoutSeconds": 2}

    container = {
        "name": "triton", "image": cfg.image,
        "command": serve_command(cfg, "/engines/triton_repo"),
        "env": [{"name": "XDG_CACHE_HOME", "value": f"{SCRATCH}/cache"}, {  # the python backend's private copy
            # the OpenAI API's key (gate.KEY_ENV) from a Secret the operator makes: the pod does not start without it
            "name": "SPORK_API_KEY", "valueFrom": {"secretKeyRef": {"name": API_KEY_SECRET[0],
                                                                   "key": API_KEY_SECRET[1]}}}],
        "volumeMounts": [{"name": "scratch", "mountPath": SCRATCH}],
        "ports": [{"name": n, "containerPort": p} for n, p in PORTS.items()],
        "startupProbe": probe("/v2/health/ready", 5, 120),  # loading the models: up to 10 minutes
        "readinessProbe": probe("/v2/health/ready", 5, 2),  # false at once while draining: no new traffic
        "livenessProbe": probe("/v2/health/live", 10, 3),
        "resources": {"requests": {"memory": f"{-(-memory_request(cfg) // (1 << 20))}Mi", "cpu": "1"}},
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "runAsUser": RUN_AS_USER},
    }
    labels = {"app.kubernetes.io/name": NAME}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": NAME, "labels": labels},
        "spec": {
            "replicas": cfg.replicas, "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": {
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(PORTS["metrics"]),
                    "prometheus.io/path": "/metrics"}},
                "spec": {"terminationGracePeriodSeconds": cfg.drain_s + 30, "containers": [container],
                         "volumes": [{"name": "scratch", "emptyDir": {}}]},
            },
        },
    }


def service() -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": NAME, "labels": {"app.kubernetes.io/name": NAME}},
            "spec": {"selector": {"app.kubernetes.io/name": NAME},
                     "ports": [{"name": n, "port": p, "targetPort": n} for n, p in PORTS.items()]}}


def pdb() -> dict:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": NAME},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": NAME}}}}


def hpa(cfg: K8sConfig) -> dict:
    def per_pod(metric: str, value: int) -> dict:
        return {"type": "Pods", "pods": {"metric": {"name": metric},
                                         "target": {"type": "AverageValue", "averageValue": str(value)}}}

    s = served(cfg.engines)
    busy = max(1, s.instances * s.slots * 3 // 4)  # scale out at three quarters of the slots in use
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": NAME},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": NAME},
                     "minReplicas": cfg.replicas, "maxReplicas": cfg.max_replicas,
                     "metrics": [per_pod(QUEUE_GAUGE, cfg.queue_target), per_pod(ACTIVE_GAUGE, busy)],
                     "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}}}}


def adapter_rules() -> dict:
    """prometheus-adapter's rules for the two gauges (merge into its config.yaml; its chart: `rules.custom`)."""
    rules = [{"seriesQuery": f'{g}{{namespace!="",pod!=""}}',
              "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
              "name": {"matches": f"^{g}$", "as": g},
              "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"} for g in (QUEUE_GAUGE,
                                                                                                     ACTIVE_GAUGE)]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{NAME}-adapter-rules"},
            "data": {"config.yaml": dump({"rules": rules})}}


def overlay(cfg: K8sConfig, gpu: bool) -> dict:
    resources = ({"limits": {"nvidia.com/gpu": 1}} if gpu else
                 {"requests": {"cpu": str(2 * served(cfg.engines).instances)}})  # ONNX Runtime: 2 threads each
    patch = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": NAME},
             "spec": {"template": {"spec": {"containers": [{"name": "triton", "resources": resources}]}}}}
    if gpu:
        patch["spec"]["template"]["spec"]["containers"][0]["command"] = serve_command(cfg, "/engines/triton_gpu")
        patch["spec"]["template"]["spec"]["tolerations"] = [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {"resources": ["../../base"], "patches": [{"patch": dump(patch)}]}


def render(cfg: K8sConfig) -> list[Path]:
    """Write OUT/base and OUT/overlays/{cpu,gpu}; returns the files written."""
    files = {"base/deployment.yaml": deployment(cfg), "base/service.yaml": service(), "base/pdb.yaml": pdb(),
             "base/hpa.yaml": hpa(cfg), "base/adapter-rules.yaml": adapter_rules()}
    kust = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "labels": [{"pairs": {"app.kubernetes.io/part-of": NAME}}],
            "resources": [Path(f).name for f in files]}
    if cfg.namespace:
        kust["namespace"] = cfg.namespace
    files["base/kustomization.yaml"] = kust
    for name in ("cpu", "gpu"):
        files[f"overlays/{name}/kustomization.yaml"] = {"apiVersion": "kustomize.config.k8s.io/v1beta1",
                                                         "kind": "Kustomization", **overlay(cfg, name == "gpu")}
    written = []
    for rel, doc in files.items():
        path = cfg.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path, "---\n" + dump(doc))
        written.append(path)
    return written
