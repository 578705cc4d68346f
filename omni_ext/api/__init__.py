"""omni-ext's HTTP side: request validation and the OpenAI-compatible ``/v1/videos`` and ``/v1/images`` routes.

A request goes ``routes`` (router, OpenAI-style errors) -> ``videos`` / ``images`` (one module per
route family) -> ``forms`` (body and field parsing) and ``validation`` (the served model's limits),
with every numeric bound in ``limits`` and the OpenAPI bodies built from it in ``schemas``;
``state`` holds what is resolved once per server (settings, job store, video backend), ``jobs`` the
durable records, ``media`` encoding off the event loop, ``errors`` the error shapes.
"""
