"""omni-ext's request scheduling decisions, as pure code (no vLLM or vLLM-Omni import).

Three mechanisms act on these decisions: the TunedExecutor (:mod:`omni_ext.executor.ranks`: its
queue over the worker ranks inside a replica), the API process's account of admitted jobs
(:mod:`omni_ext.api.queue`) and the dispatch in front of several replicas
(:mod:`omni_ext.dispatch.replicas`). Each owns one :class:`~omni_ext.scheduler.queue.JobQueue`.
What they decide lives here, so that every rule can be unit-tested on plain data and the scheduler
can grow without touching a mechanism:

- :mod:`omni_ext.scheduler.queue`: the one queue state machine (submit, admit, start, finish,
  abort; pricing, order, remaining time, predicted starts);
- :mod:`omni_ext.scheduler.layout`: the layouts the TunedExecutor runs or refuses, and the jobs a
  server's layout runs at once (slots);
- :mod:`omni_ext.scheduler.config`: the options (``--additional-config '{"omni_ext": {"scheduler": ...}}'``),
  ``cfg_mode`` among them (:class:`~omni_ext.scheduler.config.CfgMode`);
- :mod:`omni_ext.scheduler.cost`: what a job is expected to cost in time (learned online), what is
  left of a running one, and its time limit;
- :mod:`omni_ext.scheduler.admission`: which queued job should start first (priority, aging,
  longest first), when each starts, and 429 with Retry-After past the bound;
- :mod:`omni_ext.scheduler.priority`: how a request's priority travels to the queues;
- :mod:`omni_ext.scheduler.placement`: on which ranks and in which mode (pair, single) it starts;
- :mod:`omni_ext.scheduler.replicas`: which queued request goes to which vLLM-Omni replica, and when.

What a request costs in abstract units, and whether it runs CFG, is model knowledge and comes
from :mod:`omni_ext.models.families`.
"""
