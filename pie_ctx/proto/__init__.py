"""The contract between the SDK and the runtime: pure Python, no torch, no engine.

Both sides import only this package from each other's world. It owns:

* ``errors``: the typed error hierarchy, and the one way an error becomes a reply;
* ``messages``: the plain-data requests and replies (``msgspec`` Structs);
* ``checks``: one check per input kind. The SDK calls them early (a clear error before a
  round trip, the same on every transport); the engine calls them once, authoritatively,
  at its boundary; inner layers trust their callers;
* ``framing`` and ``wire``: frames and envelopes on a socket;
* ``address``: server addresses, the runtime folder and token files;
* ``tokenizer``: the model's tokenizer (the SDK's fillers tokenize; the engine decodes);
* ``stops``: streamed text and stop strings (whoever drives a generation uses it).

Importing this package imports none of its modules and nothing of the SDK's client classes.
"""
