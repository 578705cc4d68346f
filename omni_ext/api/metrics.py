"""omni-ext's Prometheus metrics, served on the server's own ``/metrics``, every definition in one place.

vLLM's API server mounts ``/metrics`` from prometheus_client's default ``REGISTRY``
(``vllm.entrypoints.serve.instrumentator.metrics.attach_router``), where vLLM-Omni's
``vllm_omni:*`` families already live; registering here puts omni-ext's next to them, named in
the same style (a ``omni_ext:`` namespace; counters exposed with ``_total``). With several API
server processes (``--api-server-count`` > 1) vLLM switches to a multiprocess registry, and each
process would account for its own requests only; omni-ext's scheduler assumes one API process.

``omni_ext:queue_depth`` and ``omni_ext:slo_attainment`` are computed when ``/metrics`` is scraped (a collector reading the live
request queues), so it is never stale between requests, and so are ``omni_ext:preemptions_total`` and
``omni_ext:paused_jobs`` and the healing figures (``omni_ext:worker_deaths_total``, ``omni_ext:worker_respawns_total``, ``omni_ext:watchdog_actions_total``,
``omni_ext:respawning``, ``omni_ext:worker_groups_respawning``), read from the executors' files; the rest are updated as things happen.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter as Tally
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

logger = logging.getLogger("omni_ext.api")

PREFIX = "omni_ext:"
#: Seconds buckets for waits and generation times: ~100 ms (a tiny image) to 30 min (a long video).
SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0)

QUEUE_DEPTH = PREFIX + "queue_depth"
QUEUE_DEPTH_HELP = "Jobs admitted and not yet started, by requested priority."

ADMITTED = Counter(PREFIX + "requests_admitted", "Generation requests admitted (a job exists for each).")
REFUSED = Counter(
    PREFIX + "requests_refused",
    "Generation requests refused before a job existed, by reason: queue_full (429: predicted wait over "
    "omni_ext.scheduler.max_wait_s), max_queued (429: omni_ext.api.max_queued jobs already admitted) or respawning "
    "(503: the workers are being replaced).",
    labelnames=("reason",),
)
CANCELLED = Counter(
    PREFIX + "requests_cancelled",
    "Admitted requests stopped before they finished, by reason: deleted (DELETE /v1/videos/{id}) or "
    "client_disconnected (a synchronous client went away).",
    labelnames=("reason",),
)
PREDICTED_WAIT = Histogram(
    PREFIX + "predicted_wait_seconds",
    "Predicted wait before start of each admitted request, at admission.",
    buckets=SECONDS_BUCKETS,
)
JOB_SECONDS = Histogram(
    PREFIX + "job_seconds",
    "Generation time of finished requests, from their start on the workers to their output (queueing excluded).",
    labelnames=("model",),
    buckets=SECONDS_BUCKETS,
)


class QueueLike(Protocol):
    def depth_by_priority(self) -> dict[int, int]: ...

    def slo_counts(self, window_s: float) -> tuple[int, int]: ...


class _QueueDepth:
    """``omni_ext:queue_depth{priority}``: jobs admitted and not yet started, summed over the live
    request queues of this process (one per server; tests make more)."""

    def __init__(self) -> None:
        self.queues: weakref.WeakSet[QueueLike] = weakref.WeakSet()

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(QUEUE_DEPTH, QUEUE_DEPTH_HELP, labels=["priority"])

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(QUEUE_DEPTH, QUEUE_DEPTH_HELP, labels=["priority"])
        depth: Tally[int] = Tally({0: 0})  # always one sample, so an idle server reports 0
        for queue in list(self.queues):
            try:
                depth.update(queue.depth_by_priority())
            except Exception:  # never break vLLM's /metrics over omni-ext's gauge
                logger.exception("omni-ext: reading the queue depth failed")
        for priority, count in sorted(depth.items()):
            family.add_metric([str(priority)], count)
        yield family


_DEPTH = _QueueDepth()
REGISTRY.register(_DEPTH)

SLO_ATTAINMENT = PREFIX + "slo_attainment"
SLO_ATTAINMENT_HELP = ("Share of the requests finished in the last window that met their deadline as admitted "
                       "(omni_ext.scheduler.slo_factor x predicted standalone time, or the request's deadline_s); "
                       "no sample for a window with none.")


class _SloAttainment:
    """``omni_ext:slo_attainment{window}``, summed over the live request queues like the depth."""

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(SLO_ATTAINMENT, SLO_ATTAINMENT_HELP, labels=["window"])

    def collect(self) -> Iterator[Metric]:
        from omni_ext.scheduler.slo import WINDOWS_S

        family = GaugeMetricFamily(SLO_ATTAINMENT, SLO_ATTAINMENT_HELP, labels=["window"])
        for window in WINDOWS_S:
            met = total = 0
            for queue in list(_DEPTH.queues):
                try:
                    m, n = queue.slo_counts(window)
                except Exception:  # never break vLLM's /metrics over omni-ext's gauge
                    logger.exception("omni-ext: reading SLO attainment failed")
                    continue
                met, total = met + m, total + n
            if total:
                family.add_metric([f"{window:.0f}s"], met / total)
        yield family


REGISTRY.register(_SloAttainment())


PREEMPTIONS = PREFIX + "preemptions"
PREEMPTIONS_HELP = ("Running jobs paused at a denoise step so that another started (step-level preemption), by reason: "
                    "priority (a better requested priority waited) or deadline (a job would have missed its deadline).")
PAUSED_JOBS = PREFIX + "paused_jobs"
PAUSED_JOBS_HELP = "Jobs paused now by step-level preemption (their state waits in worker memory)."


class _Preemptions:
    """``omni_ext:preemptions_total{reason}`` and ``omni_ext:paused_jobs``: counted by the TunedExecutors
    of this server (in their engine processes) and read from the files they keep
    (:func:`omni_ext.progress.read_preemptions`) when ``/metrics`` is scraped."""

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(PREEMPTIONS, PREEMPTIONS_HELP, labels=["reason"])
        yield GaugeMetricFamily(PAUSED_JOBS, PAUSED_JOBS_HELP)

    def collect(self) -> Iterator[Metric]:
        from omni_ext.progress import read_preemptions
        from omni_ext.scheduler.preempt import REASONS

        try:
            counts, paused = read_preemptions()
        except Exception:  # never break vLLM's /metrics over omni-ext's metrics
            logger.exception("omni-ext: reading the preemption counts failed")
            counts, paused = {}, 0
        family = CounterMetricFamily(PREEMPTIONS, PREEMPTIONS_HELP, labels=["reason"])
        for reason in sorted(set(REASONS) | set(counts)):
            family.add_metric([reason], counts.get(reason, 0))
        yield family
        yield GaugeMetricFamily(PAUSED_JOBS, PAUSED_JOBS_HELP, value=paused)


REGISTRY.register(_Preemptions())


WORKER_DEATHS = PREFIX + "worker_deaths"
WORKER_DEATHS_HELP = "TunedExecutor worker processes that died without being asked to (each fails the jobs on its CFG group)."
RESPAWNS = PREFIX + "worker_respawns"
RESPAWNS_HELP = ("Times a TunedExecutor replaced the workers of a CFG group and reloaded the model there after a death "
                 "or a watchdog kill.")
WATCHDOG = PREFIX + "watchdog_actions"
WATCHDOG_HELP = ("Jobs past their time limit, by action: stop (stopped at their next denoise step) or kill (not stopped "
                 "within omni_ext.healing.grace_s: their workers were killed and replaced).")
RESPAWNING = PREFIX + "respawning"
RESPAWNING_HELP = "1 while no worker group of the server can serve because all are replaced (admission answers 503 respawning), else 0."
GROUPS_RESPAWNING = PREFIX + "worker_groups_respawning"
GROUPS_RESPAWNING_HELP = ("TunedExecutor worker groups being replaced now; the other groups serve meanwhile (/health says "
                          "degraded).")


class _Healing:
    """Worker deaths, respawns and watchdog actions, counted by the TunedExecutors of this server (in
    their engine processes) and read from their healing records (:func:`omni_ext.progress.read_healing`)
    when ``/metrics`` is scraped."""

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(WORKER_DEATHS, WORKER_DEATHS_HELP)
        yield CounterMetricFamily(RESPAWNS, RESPAWNS_HELP)
        yield CounterMetricFamily(WATCHDOG, WATCHDOG_HELP, labels=["action"])
        yield GaugeMetricFamily(RESPAWNING, RESPAWNING_HELP)
        yield GaugeMetricFamily(GROUPS_RESPAWNING, GROUPS_RESPAWNING_HELP)

    def collect(self) -> Iterator[Metric]:
        from omni_ext.progress import Healing, read_healing

        try:
            state = read_healing()
        except Exception:  # never break vLLM's /metrics over omni-ext's metrics
            logger.exception("omni-ext: reading the healing records failed")
            state = Healing()
        counts = state.counts
        yield CounterMetricFamily(WORKER_DEATHS, WORKER_DEATHS_HELP, value=counts.get("worker_deaths", 0))
        yield CounterMetricFamily(RESPAWNS, RESPAWNS_HELP, value=counts.get("respawns", 0))
        family = CounterMetricFamily(WATCHDOG, WATCHDOG_HELP, labels=["action"])
        for action in ("stop", "kill"):
            family.add_metric([action], counts.get(f"watchdog_{action}s", 0))
        yield family
        yield GaugeMetricFamily(RESPAWNING, RESPAWNING_HELP, value=int(state.respawning))
        yield GaugeMetricFamily(GROUPS_RESPAWNING, GROUPS_RESPAWNING_HELP, value=state.groups_respawning)


REGISTRY.register(_Healing())


def track(queue: QueueLike) -> None:
    """Report ``queue``'s depth on ``/metrics`` for as long as it lives."""
    _DEPTH.queues.add(queue)
