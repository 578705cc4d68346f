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

In :func:`simulate` predictions are exact (a job runs for its predicted seconds) and nothing is
preempted: the figures isolate the order. :func:`simulate_preemptive` adds what the TunedExecutor
does and a real host does to it: step-level preemption (:func:`omni_ext.scheduler.preempt.choose`
with the queue pressure the executor computes, a pause taking effect at the end of the step in
flight, the paused job resuming on its slot when the job run over it ends) and runs that differ from
their prediction (each a seeded factor of its predicted seconds), with the slowdown measured against
a yardstick of the caller's (the fastest server's standalone time, as ``omni-ext bench stream``
does). ``python -m omni_ext.bench.stream_sim`` prints both tables as JSON.
"""

from __future__ import annotations

import heapq
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from omni_ext.bench.common import percentile
from omni_ext.bench.schedule import makespan_bound
from omni_ext.scheduler import admission, preempt
from omni_ext.scheduler.admission import Ticket, in_order
from omni_ext.scheduler.config import ORDERS, CfgMode, SchedulerConfig
from omni_ext.scheduler.placement import JobMode, JobNeeds, Layout


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
            order = in_order(queued.values(), now, config, capacity=capacity)
            for t in order[:free]:
                del queued[t.id]
                starts[t.id] = now
                heapq.heappush(running, (now + by_id[t.id].seconds, t.id))
    return done


@dataclass
class _Slot:
    id: str
    end: float
    paused: tuple[str, float] | None = None  # (job, its seconds left) paused under the running one


def simulate_preemptive(jobs: Sequence[Job], capacity: int, config: SchedulerConfig, *, step_s: float,
                        slower: tuple[float, float] = (1.0, 1.0), seed: int = 0) -> list[Done]:
    """Run ``jobs`` on ``capacity`` one-rank slots as the TunedExecutor does: the order's first jobs
    start on free slots; when the next one cannot, :func:`~omni_ext.scheduler.preempt.choose` may
    pause a running job for it (at the end of the step in flight: a uniform share of ``step_s``), and
    the paused job resumes on its slot when the job run over it ends (one paused job per slot, the job
    run over it is not paused itself). A job's ``seconds`` is what the executor predicts; it runs for
    that times a factor drawn uniformly from ``slower`` (seeded). The running jobs' time left is
    known exactly (the executor measures it from their steps). Deadlines are re-checked every 0.2 s
    while a job waits, as the executor does."""
    rng = random.Random(seed)
    pending = sorted(jobs, key=lambda j: (j.arrival, j.id))
    by_id = {j.id: j for j in jobs}
    actual = {j.id: j.seconds * rng.uniform(*slower) for j in pending}
    layout = Layout.regular(capacity, 1)
    slots: list[_Slot | None] = [None] * capacity
    tickets: dict[str, Ticket] = {}  # every job's, from its arrival (a running job's deadline too)
    queued: dict[str, Ticket] = {}
    starts: dict[str, float] = {}
    pauses: dict[str, int] = {}
    done: list[Done] = []
    i, now = 0, 0.0
    while i < len(pending) or queued or any(slots):
        nxt = [pending[i].arrival] if i < len(pending) else []
        nxt += [s.end for s in slots if s] + ([now + 0.2] if queued else [])
        now = max(now, min(nxt))
        for k, s in enumerate(slots):
            if s is not None and s.end <= now + 1e-12:
                done.append(Done(by_id[s.id], starts[s.id], s.end))
                slots[k] = _Slot(s.paused[0], now + s.paused[1]) if s.paused else None
        while i < len(pending) and pending[i].arrival <= now:
            j = pending[i]
            tickets[j.id] = queued[j.id] = Ticket(j.id, j.priority, j.arrival, cost=j.seconds, predicted_s=j.seconds,
                                                  deadline_s=j.deadline_s)
            i += 1
        if not queued:
            continue
        order = in_order(queued.values(), now, config, capacity=capacity)
        free = [k for k, s in enumerate(slots) if s is None]
        for k, t in zip(free, order):
            del queued[t.id]
            starts[t.id] = now
            slots[k] = _Slot(t.id, now + actual[t.id])
        if len(free) >= len(order) or not config.preempt:
            continue
        head, behind = order[len(free)], order[len(free) + 1:]
        slo = config.slo_factor
        busy = [s.end - now + (s.paused[1] if s.paused else 0.0) for s in slots if s]
        deadline, at_risk = admission.queue_pressure(
            now, busy, [(t.predicted_s, t.deadline(slo)) for t in [head, *behind]], capacity)
        waiting = preempt.Waiting(head.id, JobNeeds(JobMode.SINGLE), head.priority, head.predicted_s, deadline,
                                  at_risk, arrival=head.arrival)
        running = [preempt.Running(s.id, tickets[s.id].priority, (k,), remaining_s=s.end - now,
                                   deadline=tickets[s.id].deadline(slo), preemptions=pauses.get(s.id, 0),
                                   preemptible=s.paused is None and s.end - now > step_s, arrival=tickets[s.id].arrival)
                   for k, s in enumerate(slots) if s]
        got = preempt.choose(waiting, running, [], layout, now=now, cfg_mode=CfgMode.ADAPTIVE,
                             max_preemptions=config.max_preemptions,
                             deadlines=preempt.deadline_pauses(config.order))
        if got is None:
            continue
        k = next(k for k, s in enumerate(slots) if s is not None and s.id == got.victim)
        at = now + step_s * rng.random()  # the step in flight ends
        pauses[got.victim] = pauses.get(got.victim, 0) + 1
        del queued[head.id]
        starts[head.id] = at
        slots[k] = _Slot(head.id, at + actual[head.id], paused=(got.victim, slots[k].end - at))
    return done


def preemptive_run(*, loads: Sequence[float] = (0.5, 0.7, 0.9), capacity: int = 2, n: int = 300,
                   seeds: Sequence[int] = (0, 1, 2), yardstick: tuple[float, float] = (0.50, 3.44),
                   predicted: tuple[float, float] = (0.58, 3.50), contention: float = 1.08, steps: int = 20,
                   slower: tuple[float, float] = (0.95, 1.15), short_share: float = 0.75,
                   config: SchedulerConfig | None = None) -> dict:
    """``omni-ext bench stream``'s workload on :func:`simulate_preemptive`, with its figures from run 3
    (README): the yardstick (the fastest server's standalone short and long seconds), what the
    TunedExecutor predicts for them, how much slower two jobs side by side run (the capacity is
    divided by it, and every run is that much slower), the long job's steps (its step time: how long a
    pause waits); mean figures over ``seeds``. And 81/17-frame bursts (``omni-ext bench mixed``'s
    4.63 s / 1.73 s jobs) in three arrival orders, queued at once as the executor's settle gathers
    them: mean and worst makespan over the bound over the seeds."""
    base = config or SchedulerConfig()
    short_y, long_y = yardstick
    out: dict = {"capacity": capacity, "n": n, "seeds": list(seeds), "yardstick_s": yardstick,
                 "predicted_s": predicted, "contention": contention, "slower": slower, "stream": {}, "burst": {}}
    mean_y = short_share * short_y + (1 - short_share) * long_y
    mean_p = short_share * predicted[0] + (1 - short_share) * predicted[1]
    for load in loads:
        per_seed = []
        for seed in seeds:
            # arrivals at ``load`` of the yardstick's capacity over the contention (bench stream's rate),
            # each job predicted at the TunedExecutor's own seconds
            jobs = poisson_stream(load=load * mean_p / (mean_y * contention), capacity=capacity, n=n, seed=seed,
                                  short_s=predicted[0], long_s=predicted[1], short_share=short_share)
            ran = simulate_preemptive(jobs, capacity, base, step_s=predicted[1] / steps,
                                      slower=(slower[0] * contention, slower[1] * contention), seed=seed)
            per_seed.append(_against(ran, {"short": short_y, "long": long_y}))
        out["stream"][f"{load:g}"] = {k: round(sum(f[k] for f in per_seed) / len(per_seed), 3) for k in per_seed[0]}
    short_b, long_b = 1.73, 4.63
    arrivals = {"given": [long_b, short_b] * 3, "longest_last": [short_b] * 3 + [long_b] * 3,
                "alternating_short_first": [short_b, long_b] * 3}
    for name, seconds in arrivals.items():
        bound = makespan_bound(seconds, capacity)["bound_s"]
        jobs = [Job(f"b{k:05d}", "burst", 0.0, x) for k, x in enumerate(seconds)]
        spans = [max(d.finish for d in simulate_preemptive(jobs, capacity, base, step_s=long_b / steps,
                                                            slower=(0.97, 1.03), seed=seed)) / bound for seed in seeds]
        out["burst"][name] = {"mean_makespan_over_bound": round(sum(spans) / len(spans), 3),
                              "worst_makespan_over_bound": round(max(spans), 3)}
    return out


def _against(done: Sequence[Done], yardstick: dict[str, float]) -> dict:
    """SLO attainment and per-class slowdowns of ``done`` against ``yardstick`` seconds per class."""
    slow = [((d.finish - d.job.arrival) / yardstick[d.job.cls], d.job.cls) for d in done]
    out = {f"slo{f:g}_attainment": sum(v <= f + 1e-9 for v, _ in slow) / len(slow) for f in (3.0, 5.0)}
    for cls in ("short", "long"):
        mine = [v for v, c in slow if c == cls]
        out[f"{cls}_p50_slowdown"] = percentile(mine, 50)
        out[f"{cls}_p99_slowdown"] = percentile(mine, 99)
    return out


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
    print(json.dumps({"exact": run(), "preemptive": preemptive_run()}, indent=2))
