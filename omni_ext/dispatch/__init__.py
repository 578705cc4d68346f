"""omni-ext's dispatch in front of several vLLM-Omni replicas: the head keeps the queue and binds each
diffusion request to a replica when it can start there (:mod:`omni_ext.dispatch.replicas`).

The mechanism beside the TunedExecutor (:mod:`omni_ext.executor`, inside a replica) and the API's
account of admitted jobs (:mod:`omni_ext.api.queue`); its decisions are pure code in
:mod:`omni_ext.scheduler.replicas`. The ``replica-dispatch`` patch (:mod:`omni_ext.patches.replica_dispatch`)
hooks it into vLLM-Omni's ``StagePool``.
"""
