"""The fleet: pie-ctx engines as Ray Serve replicas, routed by session and by prefix.

Owns nothing of an engine: each replica runs ``pie-ctx serve`` as it runs alone (the same
HTTP API, channels, hosted inferlets and /metrics), on a snapshot folder shared with the
other replicas (``--shared-snapshots``) and publishing its KV events (``--kv-events``).
What the fleet adds is the front: an ingress that reads what a request names (a session,
a prompt), and a Ray Serve request router that sends it where its pages are.

Modules: ``replica`` (the engine deployment), ``engines`` (a replica's engine process,
and the engines ``pie-ctx fleet`` boots before Ray for replicas to adopt), ``engine_proc``
(the engine process itself), ``router`` (the request router), ``prefix`` (the KV-event
index of which replica holds which pages), ``sessions`` (what a request names),
``ingress`` (the HTTP front), ``app`` (``build_app`` and ``pie-ctx fleet``). Importing
this package imports no Ray; most of its modules need the optional extra
``pie-ctx[ray]``. docs/scale-out.md.
"""
