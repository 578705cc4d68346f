"""omni-ext's request scheduling decisions, as pure code (no vLLM or vLLM-Omni import).

The TunedExecutor (:mod:`omni_ext.executor.tuned`) owns the mechanism: worker processes, pipes,
locks and futures. What it decides with them lives here, so that every rule can be unit-tested on
plain data and the scheduler can grow (cost model, admission, priorities) without touching the
executor:

- :mod:`omni_ext.scheduler.placement`: which queued job starts now, on which ranks, in which mode;
- :mod:`omni_ext.scheduler.cost`: what a job is expected to cost in time, and its time limit.

What a request costs in abstract units, and whether it runs CFG, is model knowledge and comes
from :mod:`omni_ext.models.families`.
"""
