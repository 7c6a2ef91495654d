"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-sequence seeded generators, logprobs.

Random rows draw with the exponential-race trick (``argmax p_i / E_i`` with ``E_i ~ Exp(1)`` from
the sequence's own ``torch.Generator``), so a seeded sequence draws the same numbers whatever else
shares its batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kvtier.sampling_params import SamplingParams
from kvtier.sequence import TokenLogprobs


@dataclass(frozen=True)
class SampleRequest:
    row: int  # row of the logits tensor (several sequences may share a row: n > 1 forks)
    seq_id: str
    index: int  # the sequence's index within its request
    params: SamplingParams
    banned_token_ids: tuple[int, ...] = ()  # EOS/stop ids while min_tokens are not out yet


def _seed_for(seed: int, index: int) -> int:
    digest = hashlib.sha256(f"kvtier-sample:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Sampler:
    def __init__(self, engine_seed: int = 0):
        self.engine_seed = engine_seed
        self._generators: dict[str, torch.Generator] = {}
        self._num_unseeded = 0

    def _generator(self, req: SampleRequest) -> torch.Generator:
        gen = self._generators.get(req.seq_id)
        if gen is None:
            gen = torch.Generator()
            if req.params.seed is not None:
                gen.manual_seed(_seed_for(req.params.seed, req.index))
            else:
                self._num_unseeded += 1
                gen.manual_seed(_seed_for(self.engine_seed, -self._num_unseeded))
            self._generators[req.seq_id] = gen
        return gen

    def release(self, seq_id: str) -> None:
        self._generators.pop(seq_id, None)

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, reqs: list[SampleRequest]
    ) -> list[tuple[int, TokenLogprobs | None]]:
        """logits: [N, V] float32. Returns (token id, logprobs or None) per request, in order."""
        results: list[tuple[int, TokenLogprobs | None]] = []
        greedy_rows = [r.row for r in reqs if r.params.greedy and not r.banned_token_ids]
        greedy_tokens: dict[int, int] = {}
        if greedy_rows:
            picked = logits[greedy_rows].argmax(dim=-1).tolist()
            greedy_tokens = dict(zip(greedy_rows, picked, strict=True))
        for r in reqs:
            row = logits[r.row]
            if r.params.greedy and not r.banned_token_ids:
                token = greedy_tokens[r.row]
            else:
                token = self._sample_row(row, r)
            results.append((token, self._logprobs(row, token, r.params.logprobs)))
        return results

    def _sample_row(self, row: torch.Tensor, r: SampleRequest) -> int:
        p = r.params
        x = row.clone()
        if r.banned_token_ids:
            x[list(r.banned_token_ids)] = float("-inf")
        if p.greedy:
            return int(x.argmax())
        x.div_(p.temperature)
        if 0 < p.top_k < x.shape[0]:
            kth = torch.topk(x, p.top_k).values[-1]
            x.masked_fill_(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_probs, dim=-1)
            drop_sorted = (cum - sorted_probs) > p.top_p  # keep the smallest prefix reaching top_p
            probs[order[drop_sorted]] = 0.0
        if p.min_p > 0.0:
            probs.masked_fill_(probs < p.min_p * probs.max(), 0.0)
        noise = torch.empty_like(probs).exponential_(generator=self._generator(r))
        return int((probs / noise).argmax())

    @staticmethod
    def _logprobs(row: torch.Tensor, token: int, k: int | None) -> TokenLogprobs | None:
        if k is None:
            return None
        lp = torch.log_softmax(row, dim=-1)
        top: dict[int, float] = {}
        if k > 0:
            values, ids = torch.topk(lp, k)
            top = dict(zip(ids.tolist(), values.tolist(), strict=True))
        return TokenLogprobs(token, float(lp[token]), top)
