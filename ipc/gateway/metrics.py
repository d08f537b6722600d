"""Prometheus metrics of the gateway, named as vLLM's with a ``forerun:`` prefix.

Two sources:

* per-request figures, observed by each gateway worker when a request ends
  (counters and histograms); with several workers, prometheus_client's
  multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by
  ``ipc/gateway/process.py`` before a worker imports this module) keeps them in
  files that any worker's ``/metrics`` adds up;
* the scheduler's state (running, waiting, KV blocks, preemptions, step
  times), read from ``ServerStats`` at scrape time: nothing runs between scrapes;
  behind a data-parallel router, one sample per replica (label ``replica``).

The series (labelled ``model_name``):

* gateway: ``request_success_total{finished_reason}``, ``prompt_tokens_total``,
  ``generation_tokens_total`` (counters); ``time_to_first_token_seconds``,
  ``time_per_output_token_seconds``, ``inter_token_latency_seconds``,
  ``e2e_request_latency_seconds`` (histograms, vLLM's buckets, from the SDK's timings);
* scheduler: ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc`` (0 to 1),
  ``num_kv_blocks_used``, ``num_kv_blocks_free``, ``num_host_kv_blocks_free`` (gauges);
  ``num_preemptions_total``, ``steps_total``, ``executor_restarts_total``, ``api_worker_restarts_total``,
  ``prefix_cache_queries_total``, ``prefix_cache_hits_total``, ``prefix_cache_host_hits_total``
  (tokens looked up and found at admission), ``step_time_seconds_total``, ``gpu_busy_seconds_total``,
  ``gpu_idle_seconds_total``, ``executor_idle_seconds_total`` (counters, summed from each
  ``StepResult``); ``gpu_idle_fraction`` (idle / (busy + idle) since start: CUDA-event gaps on a
  GPU, else the executor's waits for plans; use ``rate()`` of the counters for a window);
  structured outputs: ``structured_requests_total``, ``grammar_cache_hits_total``,
  ``grammar_compile_seconds`` (a histogram; ``ipc/gateway/structured.py``); speculative decoding:
  ``spec_decode_num_drafts_total`` (speculative rows), ``spec_decode_num_draft_tokens_total``,
  ``spec_decode_num_accepted_tokens_total``, ``spec_decode_mean_accepted_length`` (tokens a row emits, a gauge).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import os
from typing import Iterable, Iterator, Optional

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from ipc.gateway.structured import grammar_metrics
from ipc.protocol import ServerStats

# vLLM's buckets, so that dashboards' bucket queries carry over.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
LABELS = ("model_name",)


class RequestMetrics:
    """Counters and histograms of finished requests; one per process (see :func:`request_metrics`)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.prompt_tokens = Counter("forerun:prompt_tokens", "Prefill tokens processed.", LABELS)
        self.generation_tokens = Counter("forerun:generation_tokens", "Generation tokens produced.",
                                         LABELS)
        self.request_success = Counter("forerun:request_success", "Requests finished, by finish reason.",
                                       LABELS + ("finished_reason",))
        self.ttft = Histogram("forerun:time_to_first_token_seconds", "Time to first token, in seconds.",
                              LABELS, buckets=TTFT_BUCKETS)
        self.tpot = Histogram("forerun:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request, in seconds.",
                              LABELS, buckets=TOKEN_LATENCY_BUCKETS)
        self.itl = Histogram("forerun:inter_token_latency_seconds",
                             "Time between consecutive token arrivals, in seconds.",
                             LABELS, buckets=TOKEN_LATENCY_BUCKETS)
        self.e2e = Histogram("forerun:e2e_request_latency_seconds", "End-to-end request latency, in seconds.",
                             LABELS, buckets=E2E_BUCKETS)
        self._per_reason: dict[str, Counter] = {}
        self._pending: list = []  # finished requests not yet written (see observe)

    def observe(self, result) -> None:
        """Record one finished request (a ``GenerateResult`` of the SDK), with the others that end this loop turn.

        A step that ends a few hundred requests wakes them all in one turn of the event loop:
        their figures are written together once the turn's callbacks have run (``flush``),
        one store per counter and per histogram bucket touched instead of about eleven
        stores per request (each a locked write into a memory-mapped file).
        """
        self._pending.append(result)
        if len(self._pending) == 1:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no running loop: write at once
                self.flush()

    def flush(self) -> None:
        """Write the figures of the requests observed since the last flush."""
        done, self._pending = self._pending, []
        if not done:
            return
        m = self.model_name
        self.prompt_tokens.labels(m).inc(sum(r.prompt_tokens for r in done))
        # n > 1: every completion's tokens (the result's own fields are its first completion's).
        self.generation_tokens.labels(m).inc(sum(c.completion_tokens for r in done for c in r.choices or [r]))
        for reason, count in collections.Counter(r.finish_reason for r in done).items():
            counter = self._per_reason.get(reason)
            if counter is None:
                counter = self._per_reason[reason] = self.request_success.labels(m, reason)
            counter.inc(count)
        timings = [r.timings for r in done]
        observe_many(self.ttft.labels(m), [t.ttft for t in timings if t.ttft is not None])
        observe_many(self.tpot.labels(m), [tpot for t in timings if (tpot := t.tpot) is not None])
        observe_many(self.itl.labels(m), [gap for t in timings for gap in t.itl])
        observe_many(self.e2e.labels(m), [t.e2e for t in timings])


def observe_many(hist: Histogram, values: Iterable[float]) -> None:
    """``hist.observe(v)`` for each value, with one write per bucket touched instead of two per value.

    A request's inter-token gaps come by the hundred, as do the requests of one flush, and
    in multiprocess mode every write is a store into a memory-mapped file: per token, that
    was the gateway's largest cost after the socket write.  Uses the child histogram's bucket values,
    which prometheus_client has kept since 0.4; any other object gets plain observes.
    """
    bounds = getattr(hist, "_upper_bounds", None)
    buckets = getattr(hist, "_buckets", None)
    total = getattr(hist, "_sum", None)
    if bounds is None or buckets is None or total is None:
        for v in values:
            hist.observe(v)
        return
    counts = [0] * len(bounds)
    amount = 0.0
    for v in values:
        counts[bisect.bisect_left(bounds, v)] += 1  # the first bound >= v, as observe() picks
        amount += v
    if not any(counts):
        return
    total.inc(amount)
    for bucket, n in zip(buckets, counts):
        if n:
            bucket.inc(n)


_METRICS: Optional[RequestMetrics] = None


def request_metrics(model_name: str) -> RequestMetrics:
    """This process's RequestMetrics (prometheus_client allows each name once per process)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = RequestMetrics(model_name)
    return _METRICS


class SchedulerCollector:
    """The scheduler's gauges and counters from one ``ServerStats`` (read just before the scrape).

    Behind a data-parallel router (``ServerStats.replicas``) every series has one sample per replica, labelled
    ``replica`` (``sum by (model_name)`` gives the server's figure); a replica that is down has none, and
    ``forerun:replica_up`` (1 or 0) and ``forerun:replica_restarts`` say which is down and how often each restarted.
    """

    def __init__(self, stats: Optional[ServerStats], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        if self.stats is None:  # the scheduler did not answer: per-request metrics only
            return
        if self.stats.replicas:
            names = LABELS + ("replica",)
            samples = [([self.model_name, str(r.replica)], r) for r in self.stats.replicas]
        else:
            names, samples = LABELS, [([self.model_name], self.stats)]
        for kind, name, doc, value in SCHEDULER_SERIES:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=names)
            for labels, s in samples:
                family.add_metric(labels, value(s))
            yield family
        yield from grammar_metrics(samples, names)
        workers = CounterMetricFamily("forerun:api_worker_restarts", "Times the server started again an HTTP gateway "
                                      "worker that exited while serving.", labels=LABELS)
        workers.add_metric([self.model_name], self.stats.api_worker_restarts)  # the server's own (a router's too)
        yield workers
        if self.stats.replica_restarts:  # a data-parallel router's answer: every replica, up or down
            up = GaugeMetricFamily("forerun:replica_up", "1 while a data-parallel replica serves, 0 while it is down "
                                   "(restarting, or down for good).", labels=LABELS + ("replica",))
            restarts = CounterMetricFamily("forerun:replica_restarts", "Times the router restarted a data-parallel "
                                           "replica whose process exited.", labels=LABELS + ("replica",))
            for index, count in enumerate(self.stats.replica_restarts):
                labels = [self.model_name, str(index)]
                up.add_metric(labels, 0.0 if index in self.stats.replicas_down else 1.0)
                restarts.add_metric(labels, count)
            yield up
            yield restarts


def _kv_used(s: ServerStats) -> int:
    return s.num_kv_blocks - s.num_free_kv_blocks


# (kind, name, help, value of a ServerStats): the scheduler's series.
SCHEDULER_SERIES = (
    ("gauge", "forerun:num_requests_running", "Requests running (holding a slot).", lambda s: s.num_running),
    ("gauge", "forerun:num_requests_waiting", "Requests waiting to be admitted.", lambda s: s.num_waiting),
    ("gauge", "forerun:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
     lambda s: _kv_used(s) / s.num_kv_blocks if s.num_kv_blocks else 0.0),
    ("gauge", "forerun:num_kv_blocks_used", "KV cache blocks in use.", _kv_used),
    ("gauge", "forerun:num_kv_blocks_free", "KV cache blocks free.", lambda s: s.num_free_kv_blocks),
    ("gauge", "forerun:num_host_kv_blocks_free", "Host KV tier blocks free or cached (0 without the tier).",
     lambda s: s.num_free_host_kv_blocks),
    ("gauge", "forerun:gpu_idle_fraction", "Fraction of the device's time spent idle since start "
     "(GPU gaps on CUDA, else the executor's wait for plans).", lambda s: idle_fraction(s)),
    ("gauge", "forerun:spec_decode_mean_accepted_length", "Tokens a speculative row emitted on average (accepted "
     "drafts plus the model's own; 0 before any).",
     lambda s: (s.spec_rows + s.spec_accepted_tokens) / s.spec_rows if s.spec_rows else 0.0),
    ("counter", "forerun:num_preemptions", "Preemptions (requests sent back to waiting).", lambda s: s.preemptions),
    ("counter", "forerun:steps", "Steps run by the executor.", lambda s: s.steps),
    ("counter", "forerun:step_time_seconds", "Executor time inside steps, in seconds.", lambda s: s.step_time_s_total),
    ("counter", "forerun:gpu_busy_seconds", "GPU busy time (CUDA timing events), in seconds.",
     lambda s: s.gpu_busy_s_total),
    ("counter", "forerun:gpu_idle_seconds", "GPU idle gaps between steps (CUDA timing events), in seconds.",
     lambda s: s.gpu_gap_s_total),
    ("counter", "forerun:executor_idle_seconds", "Time the executor waited for plans, in seconds.",
     lambda s: s.executor_idle_s_total),
    ("counter", "forerun:executor_restarts", "Times the scheduler replaced a dead or hung executor.",
     lambda s: s.executor_restarts),
    ("counter", "forerun:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     lambda s: s.prefix_cache_query_tokens),
    ("counter", "forerun:prefix_cache_hits", "Prompt tokens found in the prefix cache (both tiers).",
     lambda s: s.prefix_cache_hit_tokens),
    ("counter", "forerun:prefix_cache_host_hits", "Prompt tokens found in the host KV tier (and copied back).",
     lambda s: s.prefix_cache_host_hit_tokens),
    ("counter", "forerun:spec_decode_num_drafts", "Speculative rows verified.", lambda s: s.spec_rows),
    ("counter", "forerun:spec_decode_num_draft_tokens", "Draft tokens verified.", lambda s: s.spec_draft_tokens),
    ("counter", "forerun:spec_decode_num_accepted_tokens", "Draft tokens accepted.", lambda s: s.spec_accepted_tokens),
)


def idle_fraction(s: ServerStats) -> float:
    """Idle share of the device's time: GPU gaps when CUDA timed the steps, else executor waits."""
    busy, idle = s.gpu_busy_s_total, s.gpu_gap_s_total
    if busy <= 0.0:
        busy, idle = s.step_time_s_total, s.executor_idle_s_total
    total = busy + idle
    return idle / total if total > 0 else 0.0


def render(stats: Optional[ServerStats], model_name: str) -> bytes:
    """The Prometheus text exposition: every worker's request metrics plus the scheduler's."""
    if _METRICS is not None:
        _METRICS.flush()  # this worker's requests that ended this loop turn
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SchedulerCollector(stats, model_name))
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest(REGISTRY) + generate_latest(registry)  # one process: its own metrics
