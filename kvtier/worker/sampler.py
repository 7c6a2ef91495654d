"""Token sampling: greedy, temperature, top-k, top-p, min-p, penalties, logit bias, per-sequence seeded
generators, logprobs (of the model's own distribution, before any penalty or bias).

A row's logits are edited in this order: the repetition penalty (prompt and output tokens), the
frequency and presence penalties (output tokens), the logit bias, the tokens banned while
``min_tokens`` are not out yet, then the structured-output grammar's mask.

Greedy rows are one batched argmax, on the logits' device when every row of the step is greedy and
unedited (a GPU's logits stay there: only the chosen ids and a finite flag per row come back, not a
[N, V] tensor); any other step is sampled on the CPU (per-sequence CPU generators, grammar masks and
penalties built there), its logits copied over once. Random rows share one batched softmax, then each
draws with ``torch.multinomial`` from its own ``torch.Generator``, so a seeded sequence draws the same numbers
whatever else shares its batch.

A bad row fails alone: a row whose logits are non-finite as the model gave them (corrupt K/V), a row
that turned non-finite through its parameters (values that bypassed ``SamplingParams.validate``), a
grammar that failed, or any error editing or drawing one row gives that request a :class:`RowError`
instead of a token; every other row samples exactly as it would have without it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.sampling_params import SamplingParams
from kvtier.sequence import TokenLogprobs
from kvtier.worker.structured import Grammars

logger = logging.getLogger("kvtier.sampler")


@dataclass(frozen=True)
class SampleRequest:
    row: int  # row of the logits tensor (several sequences may share a row: n > 1 forks)
    seq_id: str
    index: int  # the sequence's index within its request
    params: SamplingParams
    banned_token_ids: tuple[int, ...] = ()  # EOS/stop ids while min_tokens are not out yet
    # the sequence's tokens so far (prompt, then output) and how many are the prompt's: read only when
    # ``params.penalized`` (a reference to the sequence's own list, not a copy)
    token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0


@dataclass(frozen=True)
class RowError:
    """Why a sequence got no token this step (its request then ends with this error, no other)."""

    message: str
    model: bool = False  # the model's own logits were non-finite (corrupt K/V?), not its parameters


SampleResult = tuple[int, TokenLogprobs | None] | RowError
_MODEL_ROW = "the model's logits are not finite (NaN or inf): corrupt K/V?"

_CANDIDATES = 256  # top-k/top-p first look at this many most likely tokens


def _seed_for(seed: int, index: int) -> int:
    digest = hashlib.sha256(f"kvtier-sample:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _penalize(row: torch.Tensor, r: SampleRequest) -> None:
    """Apply ``r``'s penalties to its logits ``row`` [V] in place (vLLM's definitions and order)."""
    p, vocab = r.params, row.shape[0]

    def known(ids: Sequence[int]) -> torch.Tensor:  # a token id past the logits (added tokens) has none
        t = torch.tensor(ids, dtype=torch.long)
        return t[t < vocab]

    if p.repetition_penalty != 1.0:
        seen = known(r.token_ids).unique()
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if p.frequency_penalty or p.presence_penalty:
        out = known(r.token_ids[r.num_prompt_tokens :])
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)  # [V]
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[TokenLogprobs]:
    """Prompt tokens' logprobs: row i of ``logits`` [m, V] predicted ``targets[i]``; top-``k`` each."""
    lp = torch.log_softmax(logits, dim=-1)  # [m, V]
    index = torch.tensor(targets, dtype=torch.long, device=lp.device)[:, None]  # the logits' device
    chosen = lp.gather(1, index)[:, 0].tolist()
    tops: list[dict[int, float]] = [{} for _ in chosen]
    if k > 0:
        values, ids = torch.topk(lp, k)  # [m, k]
        tops = [dict(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return [TokenLogprobs(t, c, top) for t, c, top in zip(targets, chosen, tops, strict=True)]


class Sampler:
    def __init__(self, engine_seed: int = 0, grammars: Grammars | None = None):
        self.engine_seed = engine_seed
        self.grammars = grammars  # structured output (kvtier/worker/structured.py)
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
        if self.grammars is not None:
            self.grammars.release(seq_id)

    def _constrain(self, rows: torch.Tensor, i: int, logits: torch.Tensor, r: SampleRequest) -> None:
        """Mask row ``i`` to the tokens ``r``'s grammar allows. Where the bans took every one of them
        (min_tokens holding back the EOS that would close the grammar), the grammar wins."""
        if r.params.structured_outputs is None or self.grammars is None:
            return
        allowed = self.grammars.allowed(r.seq_id, r.params, rows.shape[1])  # bool [V]
        rows[i].masked_fill_(~allowed, float("-inf"))
        if not bool(torch.isfinite(rows[i]).any()):
            rows[i] = logits[r.row].masked_fill(~allowed, float("-inf"))

    def _edit(self, rows: torch.Tensor, i: int, logits: torch.Tensor, r: SampleRequest) -> None:
        """Row ``i``'s penalties, bias, bans and grammar mask, in that order."""
        if r.params.penalized:
            _penalize(rows[i], r)
        if r.params.logit_bias:
            bias_ids = torch.tensor(list(r.params.logit_bias), dtype=torch.long)
            rows[i, bias_ids] += torch.tensor(list(r.params.logit_bias.values()), dtype=rows.dtype)
        if r.banned_token_ids:
            rows[i, list(r.banned_token_ids)] = float("-inf")
        if r.params.allowed_token_ids is not None:
            allowed = torch.zeros(rows.shape[1], dtype=torch.bool)
            allowed[r.params.allowed_token_ids] = True
            rows[i].masked_fill_(~allowed, float("-inf"))
        self._constrain(rows, i, logits, r)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[SampleRequest]) -> list[SampleResult]:
        """logits: [N, V] float32. Returns (token id, logprobs or None) per request, in order, or a
        ``RowError`` for a request whose row cannot be sampled (no other row is affected)."""
        if logits.device.type != "cpu" and not _device_sampled(reqs):
            logits = logits.cpu()
        finite_rows = torch.isfinite(logits).all(dim=-1)  # [N]: the model's own rows
        index = [r.row for r in reqs]
        edits = any(_edited(r) for r in reqs)
        if not edits and index == list(range(logits.shape[0])):
            # one row per sequence, nothing to edit (a decode step's usual case): the argmax and the
            # finite flags come back together, one readback
            rows = logits
            tokens, finite = torch.stack((rows.argmax(dim=-1), finite_rows.long())).tolist()
            errors = {i: RowError(_MODEL_ROW, model=True) for i, r in enumerate(reqs) if not finite[r.row]}
        else:
            finite = finite_rows.tolist()
            errors = {i: RowError(_MODEL_ROW, model=True) for i, r in enumerate(reqs) if not finite[r.row]}
            rows = logits.index_select(0, torch.tensor(index, dtype=torch.long, device=logits.device))
            for i, r in enumerate(reqs):  # rows [M, V] edited
                if i not in errors:
                    self._guard(errors, i, r, self._edit, rows, i, logits, r)
            _check_edited(rows, errors)
            tokens = rows.argmax(dim=-1).tolist()  # greedy rows keep this
        self._sample_random(rows, reqs, tokens, errors)
        for i, (token, r) in enumerate(zip(tokens, reqs, strict=True)):
            if i not in errors and r.params.structured_outputs is not None and self.grammars is not None:
                self._guard(errors, i, r, self.grammars.consume, r.seq_id, token)
        return [
            errors[i] if i in errors else (token, self._logprobs(logits, r.row, token, r.params.logprobs))
            for i, (token, r) in enumerate(zip(tokens, reqs, strict=True))
        ]

    def _sample_random(
        self, rows: torch.Tensor, reqs: list[SampleRequest], tokens: list[int], errors: dict[int, RowError]
    ) -> None:
        """Draw the tokens of the rows that sample (not greedy, not failed) into ``tokens``."""
        random_ids = [i for i, r in enumerate(reqs) if not r.params.greedy and i not in errors]
        if not random_ids:
            return
        temps = torch.tensor([reqs[i].params.temperature for i in random_ids], dtype=rows.dtype)
        probs = torch.softmax(rows[random_ids] / temps[:, None], dim=-1)  # [R, V]
        ok = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
        for j, i in enumerate(random_ids):
            if not ok[j]:
                errors[i] = RowError("sampling failed: the probabilities are not finite (bad parameters)")
                continue
            drawn = self._guard(errors, i, reqs[i], self._draw, probs[j], reqs[i])
            if drawn is not None:
                tokens[i] = drawn

    @staticmethod
    def _guard(errors: dict[int, RowError], i: int, r: SampleRequest, fn: Any, *args: Any) -> Any:
        """``fn(*args)``; an exception becomes row ``i``'s ``RowError`` (logged), never the batch's."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - one row's failure must not end the step
            message = str(exc) if str(exc).startswith("structured output") else f"sampling failed: {exc}"
            logger.warning("%s: %s", r.seq_id, message)
            errors[i] = RowError(message[:500])
            return None

    def _draw(self, probs: torch.Tensor, r: SampleRequest) -> int:
        """One draw from ``probs`` [V] after top-k, top-p and min-p, with the sequence's generator.

        top-k/top-p look at the ``_CANDIDATES`` most likely tokens first and widen the candidate set
        (x16 at a time) only while it holds less than ``top_p`` of the mass — exact either way.
        """
        p = r.params
        gen = self._generator(r)
        vocab = probs.shape[0]
        if p.top_k == 0 and p.top_p >= 1.0:
            if p.min_p > 0.0:
                probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            return int(torch.multinomial(probs, 1, generator=gen))
        k = min(p.top_k if p.top_k > 0 else _CANDIDATES, vocab)
        vals, ids = torch.topk(probs, k)  # sorted, most likely first
        if p.top_k > 0:
            vals = vals / vals.sum()  # top-p applies to the top-k distribution
        if p.top_p < 1.0:
            cum = vals.cumsum(0)
            while p.top_k == 0 and k < vocab and float(cum[-1]) < p.top_p:  # widen: 256, 4096, ... all
                k = min(k * 16, vocab)
                vals, ids = torch.topk(probs, k)
                cum = vals.cumsum(0)
            keep = (cum - vals) < p.top_p  # the smallest prefix whose mass reaches top_p
            keep[0] = True  # the most likely token always stays (a top_p below float32's range keeps none)
            vals, ids = vals[keep], ids[keep]
        if p.min_p > 0.0:
            vals = vals.masked_fill(vals < p.min_p * vals[0], 0.0)
        return int(ids[torch.multinomial(vals, 1, generator=gen)])

    @staticmethod
    def _logprobs(logits: torch.Tensor, row: int, token: int, k: int | None) -> TokenLogprobs | None:
        """Row ``row``'s logprob of ``token`` and its top ``k`` (None, nothing indexed, when not asked)."""
        if k is None:
            return None
        return prompt_logprobs(logits[row][None], [token], k)[0]


def _device_sampled(reqs: list[SampleRequest]) -> bool:
    """Whether a step's rows sample where their logits are: greedy and unedited, every one of them."""
    return all(r.params.greedy and not _edited(r) for r in reqs)


def _edited(r: SampleRequest) -> bool:
    """Whether the row's logits are edited before the draw: a bias, bans, penalties, a grammar, an
    allowed set."""
    p = r.params
    return (
        bool(p.logit_bias or r.banned_token_ids or p.penalized or p.structured_outputs)
        or p.allowed_token_ids is not None
    )


def _check_edited(rows: torch.Tensor, errors: dict[int, RowError]) -> None:
    """Rows that the edits left NaN, +inf or with no finite logit fail (the model's rows were finite)."""
    bad = torch.isnan(rows).any(dim=-1) | torch.isposinf(rows).any(dim=-1) | torch.isneginf(rows).all(dim=-1)
    for i in torch.nonzero(bad).flatten().tolist():
        errors.setdefault(i, RowError("sampling failed: the logits are not finite after the parameters"))
