"""Anthropic's Messages API (``/v1/messages``): ``schema`` (the request bodies and their
mapping onto the shared conversation), ``api`` (the routes and their rendering)."""
