"""Benchmarks on real servers: ``omni-ext bench cfg-parallel|data-parallel|adaptive|mixed|admission --json OUT``.

``runner`` (executor: CFG parallel, data parallel), ``adaptive`` / ``mixed`` / ``admission`` (request
scheduler); shared pieces in ``common`` (servers, fields, figures, table, progress), ``client``
(HTTP), ``logwatch`` (server-log event times), ``schedule`` (makespan and admission arithmetic) and
``ceiling`` (the bare host's own ceiling, no server).
"""
