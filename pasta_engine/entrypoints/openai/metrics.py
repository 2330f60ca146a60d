"""The server's Prometheus metrics (``GET /metrics``): vLLM's names with the ``pasta:`` prefix,
plus PASTA's own, one registry per app."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ...engine.async_engine import AsyncEngine, StreamOutput

__all__ = ["Metrics", "Meter"]

# vLLM's histogram buckets (seconds)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                960.0, 1920.0, 7680.0)
_SPEEDUP_BUCKETS = (0.5, 1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 8.0)


class Metrics:
    """The Prometheus metrics of one app (its own registry), vLLM's names with the ``pasta:``
    prefix and a ``model_name`` label, plus PASTA's own:

    * ``pasta:num_requests_running``, ``pasta:num_requests_waiting``, ``pasta:kv_cache_usage_perc``
      (0 to 1): read from the engine at each scrape;
    * ``pasta:time_to_first_token_seconds``: from a request's arrival to its choice's first
      sampled token; ``pasta:inter_token_latency_seconds``: between a choice's successive
      outputs, divided by the tokens sampled in between (PASTA samples several per step);
      ``pasta:e2e_request_latency_seconds``: arrival to a choice's end;
    * ``pasta:prompt_tokens_total``, ``pasta:generation_tokens_total`` (all threads),
      ``pasta:request_success_total`` (label ``finished_reason``), ``pasta:threads_forked_total``;
    * ``pasta:content_speedup``: each finished choice's theoretical content speedup
      (``RequestStats.content_speedup``)."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.registry = r = CollectorRegistry()
        lab = ("model_name",)
        self.running = Gauge("pasta:num_requests_running", "Requests decoding in the engine's batch", lab,
                             registry=r).labels(model_name)
        self.waiting = Gauge("pasta:num_requests_waiting", "Requests waiting for the engine's batch", lab,
                             registry=r).labels(model_name)
        self.kv_usage = Gauge("pasta:kv_cache_usage_perc", "Fraction of KV cache pages in use (0 to 1)", lab,
                              registry=r).labels(model_name)
        self.ttft = Histogram("pasta:time_to_first_token_seconds", "Seconds from a request's arrival to its first "
                              "sampled token", lab, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("pasta:inter_token_latency_seconds", "Seconds between a choice's successive outputs per "
                             "token sampled", lab, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("pasta:e2e_request_latency_seconds", "Seconds from a request's arrival to a choice's "
                             "end", lab, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("pasta:prompt_tokens", "Prompt tokens of finished requests", lab,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("pasta:generation_tokens", "Tokens sampled by finished choices (all threads)",
                                         lab, registry=r).labels(model_name)
        self.success = Counter("pasta:request_success", "Finished choices by finish reason",
                               (*lab, "finished_reason"), registry=r)
        self.forks = Counter("pasta:threads_forked", "Threads forked by finished choices", lab,
                             registry=r).labels(model_name)
        self.content_speedup = Histogram("pasta:content_speedup", "Theoretical content speedup of finished choices "
                                         "(content tokens / critical path)", lab, buckets=_SPEEDUP_BUCKETS,
                                         registry=r).labels(model_name)
        self.model_name = model_name

    def render(self) -> tuple[bytes, str]:
        """The scrape's body and content type (the engine's gauges read now)."""
        if self.engine.is_running:
            st = self.engine.engine.stats()  # read without the engine's lock (plain counters)
            self.running.set(st["running"])
            self.waiting.set(st["waiting"])
            total = st["kv_pages_total"]
            self.kv_usage.set((total - st["kv_pages_free"]) / total if total else 0.0)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def finished(self, out: StreamOutput, seconds: float, first_of_prompt: bool) -> None:
        self.e2e.observe(seconds)
        self.success.labels(self.model_name, out.finish_reason or "unknown").inc()
        r = out.result
        if r is None:
            return
        if first_of_prompt:
            self.prompt_tokens.inc(len(r.prompt_ids))
        self.generation_tokens.inc(r.stats.tokens_decoded)
        self.forks.inc(r.stats.forks)
        speedup = getattr(r.stats, "content_speedup", None)
        if speedup is not None:
            self.content_speedup.observe(speedup)


class Meter:
    """Times the choices of one request for :class:`Metrics` (``t0``: its arrival)."""

    def __init__(self, metrics: Metrics, t0: float, n: int):
        self.metrics, self.t0, self.n = metrics, t0, n
        self.last: dict[int, float] = {}

    def output(self, i: int, out: StreamOutput) -> None:
        now = time.monotonic()
        k = len(out.token_ids)
        if k:
            if i in self.last:
                self.metrics.itl.observe((now - self.last[i]) / k)
            else:
                self.metrics.ttft.observe(now - self.t0)
            self.last[i] = now
        if out.finished:
            self.metrics.finished(out, now - self.t0, i % self.n == 0)
