"""The conversation pipeline the chat-shaped APIs share (``openai``, ``anthropic``,
``responses``): each API's folder holds only its schema, its mapping onto this pipeline,
and its rendering.

* ``errors``: :class:`ApiError`, the SDK's errors mapped onto it, the guard of a route;
* ``body``: reading and decoding a request body (a 400 names the field);
* ``turns``: turns and tools onto a ``Context`` (the chat fillers, plain history);
* ``decoding``: the sampler (one greedy rule), the tool choice, the JSON constraint;
* ``generation``: prefill, forks, token counts and latencies, the shielded release;
* ``sse``: the one producer of a server-sent event stream;
* ``keys``: :func:`~runtime.server.http.conversation.keys.key_scope`, whose a
  key-scoped resource is.

Written against the public SDK only, like the APIs over it.
"""
