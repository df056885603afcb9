"""The HTTP front door (``pie-ctx serve --http``): an OpenAI-compatible API, Prometheus
metrics and a live view of the page store, served beside the socket server on one engine.

Owner: the server process. Pieces, each in its own module:

* ``openai``, ``anthropic``, ``responses``: OpenAI's chat and text completions, Anthropic's
  Messages API and OpenAI's Responses API, one folder each (its schema, its mapping, its
  rendering), written as inferlets over the public ``pie_ctx`` SDK (they never touch the
  engine) and over one conversation pipeline (``conversation``);
* ``metrics``: ``/metrics`` (prometheus-client) and the request counters;
* ``state``: ``/v1/pie/state`` (the engine's contexts, pages and snapshots as JSON) and
  ``/`` (a page that draws it live).

:func:`create_app` assembles them into one Starlette app; :func:`serve_http` runs it with
uvicorn on the caller's event loop, so HTTP requests and socket clients share the engine,
its pages and its prefix hits.
"""

from __future__ import annotations

from runtime.server.http.app import HttpAddress, create_app, parse_http_address, serve_http

__all__ = ["HttpAddress", "create_app", "parse_http_address", "serve_http"]
