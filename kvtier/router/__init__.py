"""``kvtier router``: an OpenAI-compatible, cache-aware reverse proxy in front of ``kvtier serve`` replicas.

::

    cli.py       flags -> RouterSettings; uvicorn
    app.py       the HTTP routes (the replicas' /v1 API, /health, /metrics, /router/state, /admin/replicas)
    auth.py      the roles: client (--api-key), admin (--admin-key, off by default), metrics (--metrics-key)
    body.py      request bodies: bounded, timed, parsed (bad or too deep JSON: a 400)
    proxy.py     one request through to a replica and back, byte for byte; retry before the first byte
    disagg.py    with prefill replicas: a long prompt computed on one, its blocks published to the
                 remote tier, the request then answered by a decode replica (docs/disaggregation.md)
    core.py      Router: the state, and choose() (which replicas, best first)
    policy.py    cache_aware / round_robin / least_loaded: pure functions over numbers
    prompt.py    a request's token ids and block hashes, exactly as the engine computes them
    replicas.py  health checks, /v1/kv/info, load (/metrics); admitting a replica at run time
    index.py     ReplicaIndex: the blocks one replica holds, per medium, bounded
    sync.py      keeping the indexes current: KV event streams (Redis) or polling /v1/kv/blocks
    metrics.py   kvtier_router:... Prometheus metrics

The wire contract is the replicas' own (``kvtier.server.protocol``): the request models a body is
parsed with, the errors the router answers, how a key is presented and a tenant's salt derived.
No module here imports torch (``tests/test_router_policy.py`` checks it). See ``docs/router.md``.
"""
