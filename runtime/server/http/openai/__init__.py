"""OpenAI's chat and text completions (``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``): ``schema`` (the request bodies), ``chat`` and ``decoding`` (their
mapping onto the shared conversation), ``api`` (the routes and their rendering)."""
