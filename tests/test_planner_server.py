"""``kvtier plan --server URL`` reads a running server's pool from ``GET /v1/kv/info``, its KV groups
included: a hybrid model's sequence holds every full-attention block but only its windows' sliding ones,
so the plan counts the sequences the engine really fits, not a dense model's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier import LLM
from kvtier.planner import pool_of_server, render_pool
from kvtier.server.app import ServerSettings, create_app
from kvtier.server.serve import BackgroundServer, serve_in_thread
from tests.test_hybrid_engine import tiny_gemma


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BackgroundServer, LLM]]:
    llm = LLM(str(tiny_gemma(tmp_path_factory.mktemp("gemma"))), block_size=4, kv_device_blocks=300)
    srv = serve_in_thread(create_app(lambda: llm.engine, ServerSettings(model_name="tiny-gemma")))
    srv.wait_ready()
    yield srv, llm
    srv.stop()


def test_the_plan_of_a_hybrid_server_counts_its_groups(server: tuple[BackgroundServer, LLM]) -> None:
    srv, llm = server
    context = 200
    pool = pool_of_server(srv.url, context)
    layout = llm.engine.kv.layout
    assert len(layout.groups) == 3 and pool.num_blocks == 300 and pool.block_size == 4
    held = layout.num_blocks_held(context, 4)  # 50 full-group blocks + each sliding group's window
    assert pool.blocks_per_seq == held < 3 * context // 4
    assert pool.max_seqs == 300 // held > 300 // (3 * context // 4)
    assert f"{pool.max_seqs:,} concurrent at {context:,} tokens" in render_pool(pool)
