"""omni-ext's request scheduling decisions, as pure code (no vLLM or vLLM-Omni import).

The TunedExecutor (:mod:`omni_ext.executor.tuned`) owns the mechanism: worker processes, pipes,
locks and futures. What it decides with them lives here, so that every rule can be unit-tested on
plain data and the scheduler can grow (cost model, admission, priorities) without touching the
executor:

- :mod:`omni_ext.scheduler.config`: the options (``--additional-config '{"omni_ext": {"scheduler": ...}}'``);
- :mod:`omni_ext.scheduler.cost`: what a job is expected to cost in time (learned online), what is
  left of a running one, and its time limit;
- :mod:`omni_ext.scheduler.order`: which queued job should start first (priority, aging, longest first);
- :mod:`omni_ext.scheduler.placement`: on which ranks and in which mode (pair, single) it starts;
- :mod:`omni_ext.scheduler.admission`: predicted start, and 429 with Retry-After past the bound.

What a request costs in abstract units, and whether it runs CFG, is model knowledge and comes
from :mod:`omni_ext.models.families`.
"""
