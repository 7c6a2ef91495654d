"""Which replica serves a request: pure functions over plain numbers (no I/O, no torch, no clocks).

``cache_aware`` estimates, for every healthy replica, the time to first token in *token units* (the
cost of computing one prompt token)::

    cost(r) = compute_tokens(r) + remote_cost * remote_tokens(r) + queued_tokens(r) + load_tokens * load(r)

    cached_tokens(r)   tokens of the prompt's leading blocks held by r itself (device, host, disk): free
    remote_tokens(r)   tokens of the blocks right after those, in the shared remote tier: cheap anywhere
    compute_tokens(r)  the rest of the prompt, computed by r's prefill
    queued_tokens(r)   prefill work this router sent to r that has not produced a first byte yet
                       (the same estimate, per request): a burst of long new prompts spreads out
    load(r)            requests queued on r (running + waiting): each delays a new one's first token

The lowest cost wins. Costs within ``near_tie`` of the best (or ``min_slack`` tokens) count as equal:
among those the least loaded wins, then the one after the previous pick in turn, so a burst of one
new prefix spreads over the replicas instead of piling onto the first ("the best") one.

Every decision carries a *reason* (a metric label): ``cache_hit`` (the winner holds a prefix of the
prompt on its own tiers), ``load`` (it holds none: the estimate chose it for its queue, or for blocks
every replica can load from the remote tier), ``fallback`` (no cache information: the prompt could
not be hashed), ``round_robin`` (that policy), ``retry`` (the second attempt, after a failure before
the first byte), ``affinity`` (``keep_affinity``: the replica earlier requests with the same
``prompt_cache_key`` went to, kept while it costs at most ``AFFINITY_SLACK_LOADS`` queued requests more
than the best: a key's requests meet their prefix there even before its blocks are announced).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

POLICIES = ("cache_aware", "round_robin", "least_loaded")
REASONS = ("cache_hit", "load", "fallback", "round_robin", "retry", "affinity")
AFFINITY_SLACK_LOADS = 2.0


@dataclass(frozen=True)
class Candidate:
    """One healthy replica as the policy sees it."""

    name: str
    load: int  # requests queued on it: running + waiting
    cached_tokens: int = 0  # tokens of the prompt's leading blocks on its own tiers
    remote_tokens: int = 0  # tokens of the next leading blocks, in the shared remote tier
    queued_tokens: int = 0  # prefill work (token units) sent to it by this router, no first byte yet


@dataclass(frozen=True)
class CostModel:
    remote_cost: float = 0.1  # a block loaded from the remote tier costs this fraction of computing it
    load_tokens: float = 256.0  # one queued request delays a new one as much as this many prompt tokens
    near_tie: float = 0.05  # costs within this fraction of the best are ties...
    min_slack: float = 1.0  # ...or within this many tokens


@dataclass(frozen=True)
class Decision:
    ranking: tuple[int, ...]  # candidate positions, best first (the retry takes the second)
    reason: str
    cached_tokens: int  # the winner's estimated cached tokens (its own tiers + remote)
    costs: tuple[float, ...] = ()  # per candidate, in token units (cache_aware only)
    work: tuple[int, ...] = ()  # per candidate: its prefill_work for this request (cache_aware only)

    @property
    def choice(self) -> int:
        return self.ranking[0]


def prefill_work(c: Candidate, num_tokens: int, model: CostModel) -> float:
    """The prefill this request would cost ``c``, in token units (computed + loaded from remote)."""
    cached = min(c.cached_tokens, num_tokens)
    remote = min(c.remote_tokens, num_tokens - cached)
    return num_tokens - cached - remote + model.remote_cost * remote


def estimate(c: Candidate, num_tokens: int, model: CostModel) -> float:
    """``cost(r)`` above, in token units."""
    return prefill_work(c, num_tokens, model) + c.queued_tokens + model.load_tokens * c.load


def _rotated(positions: Sequence[int], turn: int) -> list[int]:
    """``positions`` starting at ``turn`` (mod their count): equal choices taken in turn."""
    if not positions:
        return []
    k = turn % len(positions)
    return [*positions[k:], *positions[:k]]


def cache_aware(candidates: Sequence[Candidate], num_tokens: int, model: CostModel, turn: int) -> Decision:
    """The lowest estimated TTFT; near-ties to the least loaded, then in turn."""
    costs = tuple(estimate(c, num_tokens, model) for c in candidates)
    best = min(costs)
    slack = max(model.near_tie * best, model.min_slack)
    ties = [i for i, cost in enumerate(costs) if cost <= best + slack]
    least = min(candidates[i].load for i in ties)
    first = _rotated([i for i in ties if candidates[i].load == least], turn)
    rest = sorted((i for i in range(len(candidates)) if i not in first), key=lambda i: costs[i])
    ranking = (*first, *rest)
    winner = candidates[ranking[0]]
    reason = "cache_hit" if winner.cached_tokens > 0 else "load"
    cached = min(winner.cached_tokens + winner.remote_tokens, num_tokens)
    work = tuple(round(prefill_work(c, num_tokens, model)) for c in candidates)
    return Decision(ranking, reason, cached, costs, work)


def least_loaded(candidates: Sequence[Candidate], turn: int, reason: str = "load") -> Decision:
    """The fewest queued requests; equals in turn."""
    order = sorted(range(len(candidates)), key=lambda i: candidates[i].load)
    least = candidates[order[0]].load
    first = _rotated([i for i in order if candidates[i].load == least], turn)
    ranking = (*first, *(i for i in order if i not in first))
    return Decision(ranking, reason, 0)


def round_robin(num_candidates: int, turn: int) -> Decision:
    return Decision(tuple(_rotated(range(num_candidates), turn)), "round_robin", 0)


def decide(
    policy: str,
    candidates: Sequence[Candidate],
    num_tokens: int | None,
    model: CostModel,
    turn: int,
) -> Decision:
    """The decision of ``policy``; ``num_tokens`` None: the prompt could not be hashed (fallback)."""
    if not candidates:
        raise ValueError("no candidates")
    if policy == "round_robin":
        return round_robin(len(candidates), turn)
    if policy == "least_loaded":
        return least_loaded(candidates, turn)
    if num_tokens is None:
        return least_loaded(candidates, turn, reason="fallback")
    return cache_aware(candidates, num_tokens, model, turn)


def keep_affinity(
    decision: Decision,
    candidates: Sequence[Candidate],
    preferred: int | None,
    num_tokens: int | None,
    model: CostModel,
) -> Decision:
    """``decision`` with candidate ``preferred`` (where the request's ``prompt_cache_key`` went before)
    first, unless it costs more than ``AFFINITY_SLACK_LOADS`` queued requests over the winner."""
    if preferred is None or decision.choice == preferred:
        return decision
    winner = decision.choice
    if decision.costs:
        worse = decision.costs[preferred] - decision.costs[winner]
    else:
        worse = model.load_tokens * (candidates[preferred].load - candidates[winner].load)
    if worse > model.load_tokens * AFFINITY_SLACK_LOADS:
        return decision
    ranking = (preferred, *(i for i in decision.ranking if i != preferred))
    c = candidates[preferred]
    cached = min(c.cached_tokens + c.remote_tokens, num_tokens) if num_tokens is not None else 0
    return replace(decision, ranking=ranking, reason="affinity", cached_tokens=cached)
