"""OpenAI's Responses API (``/v1/responses``): ``schema`` (the request body), ``items``
(the typed output items and stream events, and stored items as turns), ``run`` (one
response's generation and server-side tool loop), ``store`` (stored responses, each a
snapshot in its key's namespace), ``mcp`` (the configured MCP servers), ``api`` (the
routes)."""
