"""Prometheus text for /metrics: the server's own histograms and counters, plus its backend's
counters, read before each scrape (:meth:`~snac_fast.serve.engine.backend.Backend.metric_values`)."""

from __future__ import annotations

# backend value -> (Prometheus name, kind, help); a backend reports those it has
BACKEND_METRICS = {
    "engine_up": ("snac_fast_engine_up", "gauge", "whether the engine process answers"),
    "active_streams": ("snac_fast_active_streams", "gauge", "open streams (of every worker, with a shared engine)"),
    "queue_depth": ("snac_fast_queue_depth", "gauge", "pushes waiting for an engine call"),
    "steps": ("snac_fast_steps", "counter", "engine calls"),
    "step_requests": ("snac_fast_step_requests", "counter", "pushes run by engine calls"),
    "step_seconds": ("snac_fast_step_seconds", "counter", "host seconds in engine calls"),
    "failed_steps": ("snac_fast_failed_steps", "counter", "engine calls that failed"),
    "failed_steps_in_a_row": ("snac_fast_failed_steps_in_a_row", "gauge", "engine calls failed since the last that ran"),
    "idle_released": ("snac_fast_idle_released", "counter", "streams released after idling"),
    "gpu_reserved_bytes": ("snac_fast_gpu_reserved_bytes", "gauge", "GPU memory torch's caching allocator holds (the engine's process)"),
    "gpu_allocated_bytes": ("snac_fast_gpu_allocated_bytes", "gauge", "GPU memory in live tensors (the engine's process)"),
    "gpu_process_bytes": ("snac_fast_gpu_process_bytes", "gauge",
                          "GPU memory the engine's process holds, its CUDA context included (NVML; absent where it cannot say)"),
    "gpu_budget_bytes": ("snac_fast_gpu_budget_bytes", "gauge", "--gpu-memory-gb (absent without a budget)"),
}


class ServeMetrics:
    """The registry of one serving process. ``frame_seconds``: one frame of audio, the bound of a
    push that is on time (``snac_fast_late_chunks`` counts the others)."""

    def __init__(self, frame_seconds: float, max_streams: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.frame_seconds = frame_seconds
        self.registry = CollectorRegistry()
        buckets = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, frame_seconds, 0.25, 1.0)
        self.push = Histogram("snac_fast_push_seconds", "push to audio, per push that returned audio",
                              buckets=buckets, registry=self.registry)
        self.first_audio = Histogram("snac_fast_first_audio_seconds", "time to first audio added by the server: "
                                     "from the LM chunk completing the first decodable frames to the first audio out",
                                     buckets=buckets, registry=self.registry)
        self.late = Counter("snac_fast_late_chunks", "pushes whose audio took longer than one frame of audio",
                            registry=self.registry)
        self.requests = Counter("snac_fast_requests", "requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=self.registry)
        self.backend_values: dict[str, float] = {}  # set before each scrape
        families = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}
        metrics = self

        class _Backend:
            def collect(self):
                yield GaugeMetricFamily("snac_fast_max_streams", "stream slots", value=max_streams)
                for key, value in metrics.backend_values.items():
                    name, kind, doc = BACKEND_METRICS[key]
                    yield families[kind](name, doc, value=value)

        self.registry.register(_Backend())

    def observe_push(self, seconds: float) -> None:
        self.push.observe(seconds)
        if seconds > self.frame_seconds:
            self.late.inc()

    def outcome(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
