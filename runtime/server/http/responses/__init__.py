"""OpenAI's Responses API (``/v1/responses``) and Conversations API (``/v1/conversations``):
``schema`` (the request body and its input items), ``items`` (items, the response and its
stream events, typed), ``run`` (one response's generation and the server-side tool loop),
``store`` (stored responses, each a snapshot in its key's namespace), ``compact`` (KV
compaction of a context, ``/v1/responses/compact``), ``conversations``
(stored conversations, each a snapshot too, and their routes), ``mcp`` (the configured MCP
servers), ``api`` (the routes)."""
