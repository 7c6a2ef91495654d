"""Scheduler stories (torch-free): decode-first steps under a time budget, partial prefills, priorities,
per-tenant fair share, preemption victims, and admission by KV capacity.

Each story runs a real ``Scheduler`` over a real ``KVCacheManager`` in a small simulated world: a step
lasts what the cost model says it lasts (``CostModel.step_seconds``: a fixed decode step plus prefill
tokens at a fixed rate), every sampled token is ``TOKEN``, and time is that simulated clock.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from kvtier.config import SchedulerConfig
from kvtier.kv.groups import KVLayout, kv_layout
from kvtier.kv.manager import KVCacheManager
from kvtier.sampling_params import SamplingParams
from kvtier.scheduler.admission import KVAdmission
from kvtier.scheduler.preemption import CostModel
from kvtier.scheduler.scheduler import Scheduler, SchedulerOutput
from kvtier.sequence import Sequence, SequenceStatus
from kvtier.tiers.coordinator import TierCoordinator
from kvtier.tiers.host import HostTier

BLOCK = 16
TOKEN = 7  # every sampled token; the EOS id is 0, so nothing stops early
DECODE_STEP_S = 0.05
PREFILL_TOKENS_PER_S = 2000.0


@dataclass
class World:
    scheduler: Scheduler
    clock: list[float]
    steps: list[SchedulerOutput] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    first_token_at: dict[str, float] = field(default_factory=dict)
    admitted: list[str] = field(default_factory=list)  # request ids in the order they first ran
    _rng: random.Random = field(default_factory=lambda: random.Random(0))

    @property
    def now(self) -> float:
        return self.clock[0]

    def request(
        self,
        rid: str,
        prompt_len: int,
        max_tokens: int,
        priority: int = 0,
        tenant: str = "",
        prefix: list[int] | None = None,
    ) -> Sequence:
        tokens = list(prefix or [])  # then random tokens: no prefix shared with anyone else
        tokens += [self._rng.randrange(100, 30000) for _ in range(prompt_len - len(tokens))]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        seq = Sequence(f"{rid}-0", rid, 0, tokens, prompt_len, params, ("m", ""), prompt_len + max_tokens)
        seq.arrival_time, seq.priority, seq.tenant = self.now, priority, tenant
        self.scheduler.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        s = self.scheduler
        out = s.schedule()
        prefill = sum(x.num_new_tokens for x in out.prefills)
        seconds = s.cost_model.step_seconds(len(out.decodes), prefill)
        self.clock[0] += seconds
        s.advance(out)
        if s.kv.tiers is not None:
            s.kv.tiers.complete_plan(out.swap)  # the copies "ran"
        for x in out.scheduled:
            if x.seq.request_id not in self.admitted:
                self.admitted.append(x.seq.request_id)
            if x.samples:
                self.first_token_at.setdefault(x.seq.request_id, self.now)
                s.append_token(x.seq, TOKEN)
        self.steps.append(out)
        self.step_seconds.append(seconds)
        return out

    def run(self, max_steps: int = 10_000) -> None:
        while self.scheduler.running or self.scheduler.waiting:
            self.step()
            max_steps -= 1
            assert max_steps > 0, "the world never drained"
        self.scheduler.kv.pool.check_integrity()


def world(
    num_blocks: int = 1024,
    host_blocks: int = 0,
    block_bytes: int = 1,
    layout: KVLayout | None = None,
    **config: object,
) -> World:
    """A scheduler over a pool of ``num_blocks`` (and a host tier of ``host_blocks``: its copies are
    bookkeeping only, no bytes move), whose cost model says a block is ``block_bytes``; ``layout``: a
    hybrid model's KV groups (default: one full-attention group)."""
    clock = [0.0]
    cost = CostModel(block_bytes, prefill_tokens_per_s=PREFILL_TOKENS_PER_S, decode_step_s=DECODE_STEP_S)
    cfg = SchedulerConfig(max_model_len=num_blocks * BLOCK, **config)  # type: ignore[arg-type]
    tiers = TierCoordinator(HostTier(host_blocks), [], "write_back") if host_blocks else None
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching=True, tiers=tiers, layout=layout)
    return World(Scheduler(cfg, kv, [0], cost, clock=lambda: clock[0]), clock)


def _decoding(w: World, n: int, tenant: str = "") -> list[Sequence]:
    """``n`` streams, admitted and decoding."""
    seqs = [w.request(f"chat{i}", 64, 400, tenant=tenant) for i in range(n)]
    while any(s.num_output_tokens == 0 for s in seqs):
        w.step()
    return seqs


# ------------------------------------------------------------------------ decode-first, time budget
def test_story_a_long_prompt_never_stalls_eight_decoding_streams() -> None:
    w = world(max_step_ms=150.0)
    streams = _decoding(w, 8)
    # A 4,000-token prompt arrives while the 8 streams decode.
    long = w.request("long", 4000, 4)
    start = len(w.steps)
    while long.num_output_tokens == 0:
        out = w.step()
        # Every step still carries every stream's next token, first...
        assert {x.seq.request_id for x in out.decodes} >= {s.request_id for s in streams}
        # ...and lasts no longer than the step budget.
        assert w.step_seconds[-1] <= 0.150 + 1e-9
    chunks = [x.num_new_tokens for out in w.steps[start:] for x in out.prefills if x.seq is long]
    assert sum(chunks) == 4000 and len(chunks) > 10  # split across many steps

    # The same story under the legacy policy: one 2,040-token chunk shares a step with the decodes.
    old = world(scheduling_policy="legacy")
    _decoding(old, 8)
    old.request("long", 4000, 4)
    old.step()
    assert old.step_seconds[-1] > 1.0


def _with_rows(w: World, rid: str, n: int, max_tokens: int) -> list[Sequence]:
    """A request sampling ``n`` rows, forked after its prompt as the engine does (``Engine._seq_for``)."""
    parent = w.request(rid, 32, max_tokens)
    while parent.num_output_tokens == 0:
        w.step()
    rows = [parent]
    for i in range(1, n):
        prompt = parent.token_ids[:32]
        child = Sequence(f"{rid}-{i}", rid, i, prompt, 32, parent.params, ("m", ""), 32 + max_tokens)
        w.scheduler.fork(parent, child)
        w.scheduler.append_token(child, TOKEN)  # its first token, sampled from the prompt's logits
        rows.append(child)
    return rows


@pytest.mark.parametrize("policy", ["stall_free", "legacy"])
def test_story_a_requests_sixteen_rows_take_a_share_of_each_step_while_others_run(policy: str) -> None:
    """A request sampling n=16 rows, alone, decodes all 16 every step. Two chat streams start and a
    chat's long prompt arrives: while others share the engine every step carries 4 of the 16 (the rows
    that sat out longest, so each still moves at least every 4 steps), every stream, and the prompt's
    chunk; one request's bulk does not lengthen everyone's steps. Alone again, all 16 decode. A request
    with two rows is never held back. The same under both policies, with ``row_share_span`` 4 (by default,
    0, every row decodes every step)."""
    default = world(max_step_ms=150.0, scheduling_policy=policy)
    _with_rows(default, "n16", 16, 400)
    default.request("chat", 64, 30)
    assert sum(x.seq.request_id == "n16" for x in default.step().decodes) == 16
    w = world(max_step_ms=150.0, scheduling_policy=policy, row_share_span=4)
    rows = _with_rows(w, "n16", 16, 400)
    out = w.step()
    assert sum(x.seq.request_id == "n16" for x in out.decodes) == 16  # alone: every row
    streams = [w.request(f"chat{i}", 64, 30) for i in range(2)]
    chat = w.request("chat", 1500, 4)  # about 8 steps of prompt chunks
    moved_at: dict[str, list[int]] = {r.seq_id: [] for r in rows}
    while chat.num_output_tokens == 0 or any(not s.status.finished for s in streams):
        decoding = [s for s in streams if s.num_output_tokens and not s.status.finished]
        out = w.step()
        mine = [x.seq.seq_id for x in out.decodes if x.seq.request_id == "n16"]
        assert len(mine) == 4
        assert {x.seq.seq_id for x in out.decodes} >= {s.seq_id for s in decoding}  # streams: every step
        for seq_id in mine:
            moved_at[seq_id].append(len(w.steps))
    for moved in moved_at.values():  # every row moved, at least every 4 steps
        assert moved and all(b - a <= 4 for a, b in zip(moved, moved[1:], strict=False))
    while not chat.status.finished:
        w.step()
    out = w.step()
    assert sum(x.seq.request_id == "n16" for x in out.decodes) == 16  # alone again: every row
    pair = _with_rows(w, "n2", 2, 50)
    out = w.step()
    assert {x.seq.seq_id for x in out.decodes} >= {r.seq_id for r in pair}
    w.run()


def test_story_a_prefix_loaded_from_the_host_tier_is_charged_to_its_step() -> None:
    """A stream decodes. A 1,600-token prompt was computed and its tail pushed down to the host tier by
    the next prompt (a decode replica's handoff looks like this once the blocks are read from Redis).
    It returns with 16 new tokens, beside two short chats of 200 tokens. Its short step (512 tokens at
    most) would hold its 16 tokens and both chats; but loading its host blocks takes as long as
    computing ~230 tokens (5 MB blocks at 2 GB/s), so the step holds it and one chat: the step lasts
    what its budget allows, not the budget plus the copy."""
    w = world(num_blocks=160, host_blocks=400, block_bytes=5_000_000, max_step_ms=150.0)
    _decoding(w, 1)
    history = w.request("history", 1600, 1)
    while history.num_output_tokens == 0:
        w.step()
    pusher = w.request("pusher", 1600, 1)
    while pusher.num_output_tokens == 0:
        w.step()
    w.step()
    returning = w.request("returning", 1616, 1, prefix=history.token_ids[:1600])
    chats = [w.request(f"short{i}", 200, 4) for i in range(2)]
    out = w.step()
    loads = len(out.swap.loads)
    assert loads >= 40 and returning.num_output_tokens == 1  # its tail came back from the host tier
    charge = w.scheduler.cost_model.load_tokens(loads)
    assert charge >= 200
    admitted = [x.seq.request_id for x in out.prefills]
    assert admitted == ["returning", "short0"], admitted
    assert 16 + 400 <= 512 < 16 + charge + 400  # uncharged, the second chat would have fit
    assert chats[1].num_output_tokens == 0
    w.run()


def test_story_without_decodes_a_prompt_takes_the_whole_token_budget() -> None:
    w = world(max_step_ms=150.0, max_num_batched_tokens=2048)
    w.request("alone", 3000, 2)
    out = w.step()
    assert [x.num_new_tokens for x in out.prefills] == [2048]  # nobody's stream can stall


def test_story_short_prompts_overtake_a_long_prompts_remaining_chunks() -> None:
    w = world(max_step_ms=150.0, max_num_partial_prefills=1)
    _decoding(w, 4)
    long = w.request("long", 4000, 4)
    w.step()
    w.step()  # the long prompt is mid-prefill
    assert 0 < long.num_computed_tokens < 4000
    shorts = [w.request(f"short{i}", 40, 4) for i in range(3)]
    w.step()
    # Each short prompt fits in what is left of the step: all three finish their prefill now.
    assert all(s.num_output_tokens == 1 for s in shorts)
    assert long.num_computed_tokens < 4000
    # A second long prompt waits: only one prompt may stay mid-prefill at a time.
    second = w.request("long2", 3000, 4)
    w.step()
    assert second.status is SequenceStatus.WAITING
    w.run()


def test_story_without_the_partial_limit_chunks_go_in_order() -> None:
    w = world(max_step_ms=150.0, max_num_partial_prefills=0)
    _decoding(w, 4)
    long = w.request("long", 4000, 4)
    w.step()
    short = w.request("short", 40, 4)
    w.step()
    # The long prompt, admitted first, takes the budget: the short one waits for it.
    assert short.num_output_tokens == 0 and long.num_computed_tokens < 4000


def test_story_a_passed_over_prompt_is_not_starved() -> None:
    w = world(max_step_ms=150.0, max_num_partial_prefills=1)
    _decoding(w, 2)
    long = w.request("long", 2000, 2)
    w.step()
    for i in range(60):  # a steady stream of short prompts, each filling the step
        w.request(f"s{i}", 200, 2)
        w.step()
    assert long.num_output_tokens >= 1  # it still got its chunks (at the latest every STARVE_STEPS)


def test_story_a_waiting_prompt_longer_than_a_step_is_not_starved_by_prompts_that_fit() -> None:
    """An agent's 768-token prompt waits while unrelated 512-token prompts keep coming, one always
    queued ahead of it, and a step holds 512 prompt tokens: each of those finishes in one step, so the
    finishers' pass took them all and the long one never started (kvtier bench agent under stall_free
    never finished). Passed over STARVE_STEPS steps, it takes a chunk first; it completes."""
    w = world(max_num_batched_tokens=512, max_num_partial_prefills=1)
    w.request("p0", 512, 1)
    agent = w.request("agent", 768, 2)
    for i in range(1, 40):
        w.request(f"p{i}", 512, 1)  # the unrelated traffic's next prompt, queued before the step
        w.step()
        if agent.num_output_tokens:
            break
    assert agent.num_output_tokens >= 1, f"admitted so far: {w.admitted}"


def test_story_an_agents_cached_step_does_not_wait_behind_long_prompts() -> None:
    """Unrelated 512-token prompts keep every step full (512 tokens, no stream decoding). An agent's
    next step arrives: its 600-token history is cached, 48 tokens are new. It does not wait for a long
    prompt's step: the next step holds it alone (a short step), and its first token comes after it.
    A chat prompt arriving right after does not get the next step too: short steps never come two in
    a row, so the long prompts keep at least every other step."""
    w = world(max_num_batched_tokens=512)
    history = w.request("agent-step1", 600, 1)
    w.run()  # its prompt is computed and cached (37 full blocks)
    for i in range(2):
        w.request(f"p{i}", 512, 1)
    w.step()  # p0's step
    agent = w.request("agent-step2", 640, 1, prefix=history.token_ids[:600])
    w.request("p2", 512, 1)
    out = w.step()
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.prefills] == [("agent-step2", 640 - 592)]
    assert agent.num_output_tokens == 1 and w.step_seconds[-1] < 0.1  # a 48-token step, not 512
    chat = w.request("chat", 30, 1)
    out = w.step()
    assert [x.seq.request_id for x in out.prefills] == ["p1"]  # the long prompts' turn
    out = w.step()
    assert [x.seq.request_id for x in out.prefills] == ["chat"] and chat.num_output_tokens == 1
    w.run()


def test_story_a_short_prompt_is_not_held_to_a_time_budget_smaller_than_itself() -> None:
    """Beside four decoding streams on a slow CPU, the time budget leaves 30 prompt tokens a step: a
    long prompt goes in 30-token chunks. An agent's 48 new tokens still go in one short step (not after
    the long prompt's last chunk: only one prompt may be mid-prefill)."""
    w = world(max_num_batched_tokens=512)
    history = w.request("agent-step1", 600, 1)
    w.run()
    w.scheduler.cost_model.prefill_tokens_per_s = 400.0  # (0.125 s target - 0.05 s decode) * 400
    _decoding(w, 4)
    long = w.request("long", 2000, 1)
    w.step()
    assert w.steps[-1].prefills[0].num_new_tokens == 30
    agent = w.request("agent-step2", 640, 1, prefix=history.token_ids[:600])
    w.step()
    assert agent.num_output_tokens == 1 and long.num_computed_tokens == 30
    w.run()
    # A replica told to put streams first (a decode replica: the factor never widens) keeps every
    # step within its budget: the short prompt is not taken whole beside the streams.
    strict = world(max_num_batched_tokens=512, step_time_factor=2.5, step_time_max_factor=2.5)
    history = strict.request("agent-step1", 600, 1)
    strict.run()
    strict.scheduler.cost_model.prefill_tokens_per_s = 400.0
    _decoding(strict, 4)
    agent = strict.request("agent-step2", 640, 1, prefix=history.token_ids[:600])
    strict.step()
    assert agent.num_output_tokens == 0 and sum(x.num_new_tokens for x in strict.steps[-1].prefills) <= 30
    strict.run()


def test_story_on_a_slow_cpu_a_short_prompt_still_goes_in_one_step() -> None:
    # A decode step of 8 streams takes 150 ms, about max_step_ms: the target follows the measured
    # decode step (2.5 of them), so prefill keeps 1.5 decode steps' worth of every step.
    w = world(max_step_ms=150.0)
    w.scheduler.cost_model.decode_step_s = 0.150
    w.scheduler.cost_model.prefill_tokens_per_s = 1000.0
    streams = _decoding(w, 8)
    chat = w.request("chat", 200, 4)
    out = w.step()
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.prefills] == [("chat", 200)]
    assert chat.num_output_tokens == 1  # its first token after one step
    assert {x.seq.request_id for x in out.decodes} == {s.request_id for s in streams}
    assert w.step_seconds[-1] <= 2.5 * 0.150 + 1e-9  # ITL p99 stays under 3 decode steps


def test_story_a_backed_up_queue_widens_the_step_within_a_bound() -> None:
    w = world(max_step_ms=0.001)  # the target is the decode-step factor alone
    _decoding(w, 8)
    calm = w.scheduler.budget.prefill_tokens(8, w.scheduler.oldest_wait_s())
    assert calm == int(1.5 * DECODE_STEP_S * PREFILL_TOKENS_PER_S)
    backlog = [w.request(f"q{i}", 250, 4) for i in range(6)]
    w.clock[0] += 0.5  # they have queued 10 decode steps, beyond the grace of 2 target steps (5)
    wide = w.scheduler.budget.prefill_tokens(8, w.scheduler.oldest_wait_s())
    assert wide > calm
    out = w.step()
    # At most 8 x 2.5 = 20 decode steps, however long the queue has waited.
    assert w.step_seconds[-1] <= 20 * DECODE_STEP_S + 1e-9
    assert sum(x.num_new_tokens for x in out.prefills) == wide  # a whole prompt and a chunk, not 150
    w.clock[0] += 100.0
    assert w.scheduler.budget.factor(w.scheduler.oldest_wait_s()) == 20.0
    while any(s.num_output_tokens == 0 for s in backlog):
        w.step()
        assert w.step_seconds[-1] <= 20 * DECODE_STEP_S + 1e-9


def test_story_a_decode_replica_never_widens_its_steps() -> None:
    # kvtier serve --role decode: steps of at most 1.5 decode-only steps, however long prompts queue
    # (its streams' smoothness is what the replica is for; the prompts wait, or are refused early).
    w = world(max_step_ms=0.001, step_time_factor=1.5, step_time_max_factor=1.5)
    _decoding(w, 8)
    backlog = [w.request(f"q{i}", 250, 4) for i in range(6)]
    w.clock[0] += 100.0
    assert w.scheduler.budget.factor(w.scheduler.oldest_wait_s()) == 1.5
    while any(s.num_output_tokens == 0 for s in backlog):
        w.step()
        assert w.step_seconds[-1] <= 1.5 * DECODE_STEP_S + 1e-9


def test_cost_model_learns_the_marginal_prefill_rate() -> None:
    # A CPU where every step costs 100 ms of fixed work plus 2 ms per decode and 1 ms per prompt
    # token: beside decodes, a prompt token costs 1 ms (1,000 tokens/s), not its share of the fixed.
    cost = CostModel(block_bytes=1)
    rng = random.Random(1)
    for _ in range(200):
        n, p = rng.randrange(4, 12), rng.choice([0, 0, 0, 24, 64, 128, 200])
        noise = rng.uniform(-0.01, 0.01)
        cost.observe_step(n, p, 0.100 + 0.002 * n + 0.001 * p + noise)
        cost.observe_step(0, 40, 0.100 + 0.040)  # small prefill-only steps: mostly the fixed cost
    assert 800 < cost.prefill_tokens_per_s < 1250
    assert 0.10 < cost.decode_step_s < 0.13


# ------------------------------------------------------------------------------------- priorities
def test_story_priorities_order_admission() -> None:
    w = world(max_num_seqs=1)
    for rid, priority in (("batch", 5), ("urgent", -1), ("normal", 0), ("normal2", 0)):
        w.request(rid, 20, 2, priority=priority)
    w.run()
    assert w.admitted == ["urgent", "normal", "normal2", "batch"]


def test_story_legacy_admits_in_arrival_order() -> None:
    w = world(max_num_seqs=1, scheduling_policy="legacy")
    for rid, priority in (("batch", 5), ("urgent", -1), ("normal", 0)):
        w.request(rid, 20, 2, priority=priority)
    w.run()
    assert w.admitted == ["batch", "urgent", "normal"]


def test_story_preemption_takes_the_lowest_priority_then_the_latest() -> None:
    # 6 blocks; three prompts of 31 tokens hold 2 blocks each. The 33rd token needs a third block.
    w = world(num_blocks=6, preemption_mode="recompute")
    x = w.request("x", 31, 8, priority=0)
    y = w.request("y", 31, 8, priority=5)  # admitted before z, but the least important
    z = w.request("z", 31, 8, priority=0)
    while not w.steps or not w.steps[-1].preempted_seq_ids:
        w.step()
    assert w.steps[-1].preempted_seq_ids == [y.seq_id]
    assert x.status is z.status is SequenceStatus.RUNNING
    # With equal priorities the most recently admitted goes first (the legacy rule, too).
    w2 = world(num_blocks=6, preemption_mode="recompute")
    seqs = [w2.request(r, 31, 8) for r in "abc"]
    while not w2.steps or not w2.steps[-1].preempted_seq_ids:
        w2.step()
    assert w2.steps[-1].preempted_seq_ids == [seqs[2].seq_id]
    w.run()
    w2.run()


# ---------------------------------------------------------------------------------------- tenants
def test_story_a_tenants_burst_leaves_slots_for_another_tenant() -> None:
    w = world(max_num_seqs=4)
    for i in range(12):
        w.request(f"a{i}", 30, 20, tenant="A")  # a burst from tenant A
    w.clock[0] += 0.001
    for i in range(2):
        w.request(f"b{i}", 30, 20, tenant="B")  # then two requests from B
    w.step()
    running = sorted(s.request_id for s in w.scheduler.running)
    assert running == ["a0", "a1", "b0", "b1"]  # the slots are shared, not all A's

    old = world(max_num_seqs=4, scheduling_policy="legacy")
    for i in range(12):
        old.request(f"a{i}", 30, 20, tenant="A")
    for i in range(2):
        old.request(f"b{i}", 30, 20, tenant="B")
    old.run()
    w.run()
    # Under the legacy policy B waits behind the whole burst.
    assert old.first_token_at["b0"] > 5 * w.first_token_at["b0"]


def test_story_a_running_burst_gives_the_next_free_slot_to_the_other_tenant() -> None:
    w = world(max_num_seqs=4)
    for i in range(8):
        w.request(f"a{i}", 30, 10 + i, tenant="A")
    w.step()
    assert len(w.scheduler.running) == 4  # alone, A may use every slot
    w.request("b0", 30, 10, tenant="B")
    w.run()
    # The first slot A gave back went to B, ahead of A's fifth request.
    assert w.admitted.index("b0") < w.admitted.index("a4")


# ------------------------------------------------------------------------ admission by KV capacity
def _flood(admission: KVAdmission | None) -> tuple[World, list[int]]:
    """30 requests (40-token prompts, up to 120 new tokens: 10 blocks each) arrive 3 per step at a
    64-block pool; ``admission`` decides each one. Returns the world and the Retry-After values."""
    w = world(num_blocks=64, preemption_mode="recompute")
    retries: list[int] = []
    s = w.scheduler
    for i in range(30):
        if admission is not None:
            verdict = admission.check(s.kv_demand_blocks(), 10)
            if not verdict.admit:
                retries.append(verdict.retry_after_s)
                continue
        w.request(f"r{i}", 40, 120)
        if i % 3 == 2:
            before = {q.request_id for q in s.running}
            w.step()
            if admission is not None:
                left = before - {q.request_id for q in s.running} - {q.request_id for q in s.waiting}
                admission.on_finished(10 * len(left))  # finished requests gave their blocks back
    w.run()
    return w, retries


def test_story_admission_answers_503_before_preemptions_exceed_a_bound() -> None:
    bound = 3
    flooded, _ = _flood(None)
    assert flooded.scheduler.num_preemptions > bound  # everything accepted: a preemption storm

    clock = [0.0]
    admission = KVAdmission(1.0, 64, clock=lambda: clock[0])
    guarded, retries = _flood(admission)
    assert guarded.scheduler.num_preemptions <= bound
    assert retries and all(1 <= r <= 60 for r in retries)  # refused, each with a Retry-After


def test_kv_need_counts_cached_prompt_blocks_and_admission_math() -> None:
    w = world(num_blocks=64)
    seq = w.request("warm", 64, 4)
    w.run()  # its 3 full prompt blocks stay cached
    s = w.scheduler
    same = list(seq.token_ids[:64])
    assert s.num_cached_device_blocks(same, ("m", "")) == 3
    assert s.kv_need_for(same, ("m", ""), 64, 4096) == 8 - 3  # 128 tokens = 8 blocks, 3 cached
    assert s.kv_need_for(same, ("other", ""), 64, 4096) == 8  # another tenant's salt: nothing cached
    assert s.kv_need_for(same, ("m", ""), 64, 4096, n=3) == 5 + 2 * 4
    # Without max_tokens a request counts as 1,024 more tokens, within max_model_len.
    assert s.kv_need_for(same, ("m", ""), None, 4096) == (64 + 1024) // 16 - 3
    assert s.kv_need_for(same, ("m", ""), None, 256) == 256 // 16 - 3

    clock = [100.0]
    a = KVAdmission(2.0, 64, clock=lambda: clock[0])
    assert a.limit_blocks == 128
    assert a.check(0, 500).admit  # an idle server takes anything that fits the model
    v = a.check(100, 40)
    assert not v.admit and v.retry_after_s == 5  # nothing has drained yet: the default
    a.on_finished(4)
    clock[0] += 2.0
    v = a.check(100, 40)
    assert v.retry_after_s == 6  # 12 blocks over at 2 blocks/s
    assert KVAdmission(0.0, 64).check(10**6, 10**6).admit  # factor 0: off


# ------------------------------------------------------------------------ a hybrid model's KV groups
GEMMA3_270M = kv_layout((["sliding_attention"] * 5 + ["full_attention"]) * 3, 32)  # a group per layer slot


def test_story_a_hybrid_sequence_swapped_out_mid_block_resumes() -> None:
    """Gemma 3 270M's KV groups (a full one and five sliding ones, window 32) in a pool of 24 blocks:
    four 80-token prompts cannot run together, so some are swapped out to the host tier, one after 56
    tokens, in the middle of its fourth block. To resume, a chunk that reaches a fifth block needs five
    table positions in each group, 25 blocks; the 8 tokens left in its fourth block need 19. Chunks
    used to be halved down to a whole block (16 tokens), which always reached the fifth, so it waited
    for room that never came, and so did everyone behind it (``kvtier bench gpu``'s swap run of that
    shape spun forever). Halved down to the rest of its block, it resumes; everyone finishes. (The
    legacy policy, the engine's default: stall_free makes a prompt wait rather than preempt for it.)"""
    w = world(
        num_blocks=24, host_blocks=200, layout=GEMMA3_270M, scheduling_policy="legacy", preemption_mode="swap"
    )
    prefix = [w._rng.randrange(100, 30000) for _ in range(64)]
    seqs = [w.request(f"r{i}", 80, 16, prefix=prefix) for i in range(4)]
    w.run(max_steps=500)
    assert all(seq.num_output_tokens == 16 for seq in seqs)
    assert sum(w.scheduler.preemptions_by_mode.values()) > 0  # the pool did force swaps


def test_story_hybrid_prompts_that_block_each_other_are_unblocked() -> None:
    """The same KV groups in a pool of 31 blocks, 64-token chunks, six prompts (9 to 136 tokens). Two
    long ones are admitted and computed chunk by chunk, a sliding group releasing as it goes; at 128
    and 32 tokens each needs blocks the other holds, and stall_free preempts nobody for a prompt
    chunk, so no step had anything to run, for ever. A step with nothing to run now preempts the
    latest admitted (swapped to the host tier); the oldest goes on; everyone finishes."""
    w = world(
        num_blocks=31, host_blocks=400, layout=GEMMA3_270M, scheduling_policy="stall_free",
        preemption_mode="swap", max_num_batched_tokens=64,
    )  # fmt: skip
    seqs = [w.request(f"r{i}", n, 5) for i, n in enumerate([136, 9, 87, 41, 34, 116])]
    w.run(max_steps=500)
    assert all(seq.num_output_tokens == 5 for seq in seqs)
    assert w.scheduler.preemptions_by_mode["swap"] > 0
