"""A discrete-event simulator of the scheduler's order on ``capacity`` identical slots (pure; unit-tested
in ``tests/test_scheduler_stream.py``).

It plays the *same* decision the servers make (:func:`omni_ext.scheduler.admission.in_order`, with
the running jobs and the slots) on two workloads, so that an order can be judged on both sides of its
trade-off before a server runs it, and without the noise of a shared host:

- an open **stream**: Poisson arrivals (fixed seed) of a short and a long class at a given load of
  the slots' capacity; per request its slowdown (latency over its standalone seconds), SLO
  attainment at 3x and 5x (the share within that slowdown), p50/p99 slowdown per class;
- a closed **burst**: every job queued at once in a given arrival order; its makespan over the lower
  bound ``max(longest job, total / capacity)`` (:func:`omni_ext.bench.schedule.makespan_bound`).

Predictions are exact here (a job runs for its predicted seconds) and nothing is preempted: the
figures isolate the order. ``python -m omni_ext.bench.stream_sim`` prints the table as JSON.
"""

from __future__ import annotations

import heapq
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from omni_ext.bench.common import percentile
from omni_ext.bench.schedule import makespan_bound
from omni_ext.scheduler.admission import Ticket, in_order
from omni_ext.scheduler.config import ORDERS, SchedulerConfig


@dataclass(frozen=True)
class Job:
    """One request: its class, arrival, standalone seconds, priority and its own deadline (if any)."""

    id: str
    cls: str
    arrival: float
    seconds: float
    priority: int = 0
    deadline_s: float | None = None


@dataclass(frozen=True)
class Done:
    job: Job
    start: float
    finish: float

    @property
    def slowdown(self) -> float:
        return (self.finish - self.job.arrival) / self.job.seconds


def poisson_stream(*, load: float, capacity: int, n: int, seed: int, short_s: float = 1.0, long_s: float = 6.0,
                   short_share: float = 0.75) -> list[Job]:
    """``n`` jobs arriving as a Poisson process whose offered work is ``load`` x ``capacity`` slots:
    a share ``short_share`` of them short (``short_s``), the rest long (``long_s``)."""
    rng = random.Random(seed)
    mean_s = short_share * short_s + (1 - short_share) * long_s
    rate = load * capacity / mean_s  # arrivals per second
    t, jobs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        short = rng.random() < short_share
        jobs.append(Job(f"j{i}", "short" if short else "long", t, short_s if short else long_s))
    return jobs


def simulate(jobs: Sequence[Job], capacity: int, config: SchedulerConfig) -> list[Done]:
    """Run ``jobs`` on ``capacity`` slots: whenever a slot is free, the first jobs of
    :func:`~omni_ext.scheduler.admission.in_order` (given the running jobs) start."""
    pending = sorted(jobs, key=lambda j: (j.arrival, j.id))
    by_id = {j.id: j for j in jobs}
    queued: dict[str, Ticket] = {}
    running: list[tuple[float, str]] = []  # (finish, id)
    starts: dict[str, float] = {}
    done: list[Done] = []
    i, now = 0, 0.0
    while i < len(pending) or queued or running:
        nxt = min(pending[i].arrival if i < len(pending) else float("inf"),
                  running[0][0] if running else float("inf"))
        now = max(now, nxt)
        while running and running[0][0] <= now:
            finish, jid = heapq.heappop(running)
            done.append(Done(by_id[jid], starts[jid], finish))
        while i < len(pending) and pending[i].arrival <= now:
            j = pending[i]
            queued[j.id] = Ticket(j.id, j.priority, j.arrival, cost=j.seconds, predicted_s=j.seconds,
                                  deadline_s=j.deadline_s)
            i += 1
        free = capacity - len(running)
        if free > 0 and queued:
            order = in_order(queued.values(), now, config, running_remaining=[f - now for f, _ in running],
                             capacity=capacity)
            for t in order[:free]:
                del queued[t.id]
                starts[t.id] = now
                heapq.heappush(running, (now + by_id[t.id].seconds, t.id))
    return done


def stream_figures(done: Sequence[Done], factors: Sequence[float] = (3.0, 5.0)) -> dict:
    """SLO attainment at each factor, and p50/p99 slowdown per class and overall."""
    out: dict = {f"slo{f:g}_attainment": round(sum(d.slowdown <= f + 1e-9 for d in done) / len(done), 4)
                 for f in factors}
    for cls in sorted({d.job.cls for d in done}) + ["all"]:
        slow = [d.slowdown for d in done if cls in ("all", d.job.cls)]
        out[f"{cls}_p50_slowdown"] = round(percentile(slow, 50), 3)
        out[f"{cls}_p99_slowdown"] = round(percentile(slow, 99), 3)
    return out


def burst(seconds: Sequence[float], capacity: int, config: SchedulerConfig) -> dict:
    """A closed burst: every job queued at time 0 before any starts (the servers' ``settle_s`` does the
    same), its arrival order the given one (ids tie-break); makespan over its lower bound."""
    jobs = [Job(f"b{k:05d}", "burst", 0.0, s) for k, s in enumerate(seconds)]
    makespan = max(d.finish for d in simulate(jobs, capacity, config))
    bound = makespan_bound(seconds, capacity)["bound_s"]
    return {"makespan_s": round(makespan, 3), "bound_s": bound, "makespan_over_bound": round(makespan / bound, 4)}


def run(*, loads: Sequence[float] = (0.5, 0.7, 0.9), orders: Sequence[str] = ORDERS, capacity: int = 2,
        n: int = 3000, seed: int = 0, short_s: float = 1.0, long_s: float = 6.0, short_share: float = 0.75,
        burst_s: Sequence[float] | None = None, config: SchedulerConfig | None = None) -> dict:
    """Every order on the same streams (one per load) and the same burst in three arrival orders
    (given, longest last, longest first). The default burst, eight short jobs and one long, is the
    adversarial one for FIFO when the long job comes last: one slot idles while the other runs it."""
    base = config or SchedulerConfig()
    burst_s = list(burst_s) if burst_s is not None else [short_s] * 8 + [long_s]
    out: dict = {"capacity": capacity, "n": n, "seed": seed, "short_s": short_s, "long_s": long_s,
                 "short_share": short_share, "slo_factor": base.slo_factor, "stream": {}, "burst": {}}
    for load in loads:
        jobs = poisson_stream(load=load, capacity=capacity, n=n, seed=seed, short_s=short_s, long_s=long_s,
                              short_share=short_share)
        out["stream"][f"{load:g}"] = {o: stream_figures(simulate(jobs, capacity, replace(base, order=o)))
                                      for o in orders}
    arrivals = {"given": burst_s, "longest_last": sorted(burst_s), "longest_first": sorted(burst_s, reverse=True)}
    out["burst"] = {name: {o: burst(s, capacity, replace(base, order=o)) for o in orders}
                    for name, s in arrivals.items()}
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
