"""Studies, A/B harnesses and peer comparisons, run from a kvtier checkout (not shipped in the wheel).

Run each from the repository root, with the checkout's environment (``make setup``)::

    python -m benchmarks.throughput   kvtier vs HF transformers: decode, prefill, mixed, cached, start-up
                                      (``--weight-dtypes``: weight dtypes side by side, llama.cpp too)
    python -m benchmarks.kvdtype      KV cache dtypes side by side: perplexity, top-1 agreement,
                                      capacity, decode, host loads (``--fp8-study N``: the fp8 study)
    python -m benchmarks.kernels      this checkout's gguf weight kernel vs a git revision's
    python benchmarks/overload.py     goodput under overload, driven by guidellm (``make bench-overload``)

Helpers: ``decode_ab`` (decode modes timed token by token, in turn), ``kvdtype_study`` (the fp8 study's
variants), ``kv_text`` (the fixed quality text in ``data/`` and teacher forcing), ``runner`` (the
command line every ``python -m benchmarks.NAME`` shares).

What a user runs against their own deployment ships with kvtier as ``kvtier bench ...`` (serve,
multiturn, transfer, remote, cluster, advice, gpu). Nothing under ``kvtier/`` imports from here.
"""
