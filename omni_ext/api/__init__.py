"""omni-ext's HTTP side: request validation and the OpenAI-compatible ``/v1/videos`` and ``/v1/images`` routes.

A request goes ``routes`` (router, OpenAI-style errors) -> ``videos`` / ``images`` (one module per
route family) -> ``intake`` (body, fields and the served model's limits: one checked job
description) -> ``queue`` (admission: 429 past the scheduler's bound; the account of admitted jobs behind queue
positions, predicted starts and ``/metrics``), with every numeric bound in ``limits`` and the
OpenAPI bodies built from it in ``schemas``; ``state`` holds what is resolved once per server
(settings, job store, video backend, the model's limits from ``validation``, the queue sized by
:mod:`omni_ext.scheduler.layout`), ``jobs`` the durable records,
``disconnect`` what happens when a synchronous client goes away, ``media`` encoding off the event
loop, ``metrics`` omni-ext's Prometheus families, ``errors`` the error shapes.
"""
