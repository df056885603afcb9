"""OpenAI's Responses API (``/v1/responses``): ``schema`` (the request body and its input
items), ``run`` (one response's generation, its output items and stream events, and the
server-side tool loop), ``store`` (stored responses, each a snapshot in its key's
namespace), ``mcp`` (the configured MCP servers), ``api`` (the routes)."""
