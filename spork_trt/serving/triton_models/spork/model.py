"""Triton python model `spork` (decoupled): one engine core per instance steps every request together; a request
joins the running batch, streams its chunks through its response sender, and leaves when done or cancelled (the
client went away or cancelled the stream, or spork_unary sent a cancel carrying the request's cancel_key: its slot
is free at the next step; a cancel is answered with an empty final response). With every slot taken, requests queue
up to max_queue; beyond that they are answered UNAVAILABLE. A request that fails fails alone, answered with its id
only (the detail in the log). If the engine loop stops, every request is answered UNAVAILABLE at once and the gauge
spork_engine_loop_up turns 0 (a python model cannot turn its own readiness off: under `serve`, the instance stops
beating and `serve` replaces the server, watchdog.py). Custom Prometheus metrics on the
metrics port. A thin adapter: the logic is spork_trt.serving.engine_service (tested without Triton)."""
import threading
from pathlib import Path

import triton_python_backend_utils as pb_utils

from spork_trt import io_spec
from spork_trt.config import DEVICE_DTYPE
from spork_trt.loop.engine_core import CoreConfig
from spork_trt.errors import QueueFull, UserError
from spork_trt.serving.engine_service import Service, public_error
from spork_trt.serving.triton_steps import instance_device, model_parameters
from spork_trt.serving.watchdog import Heartbeat, Watch

STEP = io_spec.model_step("spork")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
METRICS = (  # (name, kind, help, Metrics field)
    ("spork_active_requests", "GAUGE", "requests holding a KV slot", "active"),
    ("spork_queued_requests", "GAUGE", "requests waiting for a KV slot", "queued"),
    ("spork_batch_tokens", "GAUGE", "tokens of the last target forward (trees and prompt chunks)", "batch_tokens"),
    ("spork_tokens_per_second", "GAUGE", "committed tokens per second, all requests (moving average)",
     "tokens_per_second"),
    ("spork_acceptance_rate", "GAUGE", "accepted / verified draft tokens of the finished requests", None),
    ("spork_engine_loop_up", "GAUGE", "1 while the engine loop runs; 0 once it stopped (requests refused UNAVAILABLE)",
     "loop_up"),
    ("spork_steps_total", "COUNTER", "engine core steps", "steps"),
    ("spork_active_request_steps_total", "COUNTER", "requests in each step, summed over steps", "active_steps"),
    ("spork_generated_tokens_total", "COUNTER", "tokens committed, all requests", "generated_tokens"),
    ("spork_prefix_cache_hits_total", "COUNTER", "requests admitted onto a finished or running request's KV rows",
     "prefix_hits"),
    ("spork_prefix_cache_reused_tokens_total", "COUNTER", "prompt tokens not prefilled: their KV rows were reused",
     "prefix_reused_tokens"),
    ("spork_prefix_cache_evictions_total", "COUNTER", "kept KV rows dropped to admit another request",
     "prefix_evictions"),
    ("spork_prefix_cache_shared_total", "COUNTER", "requests whose KV rows were copied from a running request",
     "prefix_shared"),
)


def response(chunk):
    return pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in chunk.tensors().items()])


def error_response(e):
    e = public_error(e)  # never an internal exception's text: its detail is logged under the id the client gets
    if isinstance(e, UserError):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG))
    if isinstance(e, QueueFull):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.UNAVAILABLE))
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INTERNAL))


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        core = CoreConfig(slots=int(params["slots"]), max_len=int(params["max_len"]),
                          max_queue=int(params["max_queue"]), prefix_reuse=params.get("prefix_reuse", "1") == "1")
        self.service = Service.load(Path(params["engines"]), params["draft"], tuple(params["providers"].split(",")),
                                    core, device=instance_device(params.get("device", ""), args),
                                    dtype=params.get("dtype", DEVICE_DTYPE), timeout_s=float(params.get("timeout_s", 600)))
        self.metrics, self.families = {}, []  # a family must outlive its metrics
        for name, kind, doc, field in METRICS:
            family = pb_utils.MetricFamily(name=name, description=doc, kind=getattr(pb_utils.MetricFamily, kind))
            self.families.append(family)
            labels = {"model": args["model_name"], "instance": args["model_instance_name"]}
            self.metrics[name] = (family.Metric(labels=labels), field, kind)
        self.published = {}
        watch = Watch.from_env()  # `serve`'s watchdog: beat while the loop serves (watchdog.py)
        self.beat = Heartbeat(self.service, watch) if watch else None
        self.stop = threading.Event()
        self.publisher = threading.Thread(target=self.publish, name="spork-metrics", daemon=True)
        self.publisher.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = self.inputs(request)
                if self.service.control(inputs):  # a cancel of another request: done
                    sender.send(flags=FINAL)
                    continue
                self.service.submit(
                    inputs,
                    send=lambda chunk, s=sender: s.send(response(chunk), flags=FINAL if chunk.final else 0),
                    fail=lambda e, s=sender: s.send(error_response(e), flags=FINAL),
                    close=lambda s=sender: self.cancelled(s),
                    cancelled=request.is_cancelled)
            except Exception as e:
                sender.send(error_response(e), flags=FINAL)
        return None  # responses go through each request's sender

    @staticmethod
    def cancelled(sender):
        pb_utils.Logger.log_info("spork: request cancelled, its KV slot released")
        sender.send(flags=FINAL)  # close the stream

    @staticmethod
    def inputs(request):
        tensors = {t.name: pb_utils.get_input_tensor_by_name(request, t.name) for t in STEP.inputs}
        return {name: None if t is None else t.as_numpy() for name, t in tensors.items()}

    def publish(self):
        """Copy the service's metrics into the Prometheus families twice a second, and beat while serving."""
        while not self.stop.wait(0.5):
            try:
                self.copy_metrics()
            except Exception as e:  # a metric that cannot be set must not stop the others, nor serving
                pb_utils.Logger.log_error(f"spork: metrics: {e!r}")
            try:
                if self.beat is not None:
                    self.beat.tick()
            except OSError as e:  # the beat is late: `serve` replaces the server if this lasts
                pb_utils.Logger.log_error(f"spork: heartbeat: {e!r}")

    def copy_metrics(self):
        m = self.service.metrics
        for name, (metric, field, kind) in self.metrics.items():
            value = (m.accepted_tokens / m.draft_tokens if m.draft_tokens else 0.0) if field is None \
                else float(getattr(m, field))
            if kind == "GAUGE":
                metric.set(value)
            else:
                metric.increment(value - self.published.get(name, 0.0))
                self.published[name] = value

    def finalize(self):
        self.stop.set()
        self.publisher.join()
        if self.beat is not None:
            self.beat.stop()
        self.service.close()
