"""Batched token sampling for one engine step (vLLM v1 semantics, vectorized over the batch).

Per logits row, in this order:
  1. penalties: repetition (HF: over prompt + output tokens, a positive logit is divided by the
     penalty, any other multiplied), then frequency (x count in the output) and presence
     (x 1 if in the output), OpenAI style
  2. logit bias (OpenAI's logit_bias: added to the token's logit), then banned token ids -> -inf
     (the engine bans EOS/stop ids until min_tokens outputs exist)
  3. temperature 0: argmax of those logits (greedy: exact, unaffected by the other rows)
  4. otherwise: / temperature -> min_p -> top_k -> top_p -> exponential race:
     token = argmax(probs / q) with q ~ Exp(1), which samples from probs (Gumbel-max)
Logprobs are of the raw logits (log_softmax before step 1), vLLM's default "raw_logprobs".

Seed invariant: a seeded row's noise is keyed by its request's seed and the index of the token it
samples (model.noise), so a seeded request gets the same tokens whatever else is in the batch,
wherever its row sits and whatever speculation did. The other rows share the sampler's generator
(one batched draw).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from pyserve.step.sampling_params import SamplingParams
from pyserve.model.noise import NoiseKey, keyed_exponential

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplingRows:
    """Sampling state of the N logits rows of one step. Make it with `SamplingRows.build`.

    Tensors are on the sampler's device; the plain fields are host-side summaries that let
    `Sampler.sample` skip work no row needs. A history or ban list is a [2, M] int64 tensor of
    (row, token id) pairs, one per occurrence.
    """

    temperature: torch.Tensor  # [N] f32, 0 = greedy
    top_k: torch.Tensor  # [N] int64, 0 or -1 (or >= V) = off
    top_p: torch.Tensor  # [N] f32, 1 = off
    min_p: torch.Tensor  # [N] f32, 0 = off
    noise_keys: list[NoiseKey | None]  # None = the sampler's shared generator
    num_logprobs: list[int | None]  # top logprobs wanted per row; None = no logprobs
    # The three penalties are None when no row uses any penalty.
    presence_penalty: torch.Tensor | None = None  # [N] f32
    frequency_penalty: torch.Tensor | None = None  # [N] f32
    repetition_penalty: torch.Tensor | None = None  # [N] f32
    output_history: torch.Tensor | None = None  # output tokens of rows with presence/frequency
    repetition_history: torch.Tensor | None = None  # prompt + output tokens of rows with repetition
    banned: torch.Tensor | None = None  # token ids forced to -inf
    bias: torch.Tensor | None = None  # (row, token id) pairs of logit_bias entries
    bias_values: torch.Tensor | None = None  # f32, one per pair of `bias`
    all_greedy: bool = False
    any_greedy: bool = False
    any_min_p: bool = False
    max_top_k: int = 0  # largest top_k among sampled rows; 0 = no row uses top-k
    any_top_p: bool = False
    filter_rows: torch.Tensor | None = None  # rows using top-k/top-p, when not all rows
    seeded_rows: list[tuple[int, NoiseKey]] = field(default_factory=list)  # sampled rows
    shared_rows: torch.Tensor | None = None  # rows on the shared generator; None = all rows
    max_num_logprobs: int | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        noise_keys: list[NoiseKey | None],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        banned_token_ids: Sequence[Sequence[int]] | None,
        device: torch.device | str,
    ) -> SamplingRows:
        """Batches per-request state: one host-to-device copy per kind of field, none per row."""
        n = len(params)
        if not len(noise_keys) == len(prompt_token_ids) == len(output_token_ids) == n or (
            banned_token_ids is not None and len(banned_token_ids) != n
        ):
            raise ValueError("build needs one noise key, prompt, output (and banned) list per row")
        per_row = [
            [p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty]
            for p in params
        ]
        floats = torch.tensor(per_row, dtype=torch.float32).reshape(n, 6).T.contiguous().to(device)
        greedy = [p.greedy for p in params]
        sampled = [i for i in range(n) if not greedy[i]]
        filt = [i for i in sampled if params[i].top_k > 0 or params[i].top_p < 1.0]
        seeded = [(i, noise_keys[i]) for i in sampled if noise_keys[i] is not None]
        seeded_ids = {i for i, _ in seeded}
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        rows = cls(
            temperature=floats[0],
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=floats[1],
            min_p=floats[2],
            noise_keys=list(noise_keys),
            num_logprobs=[p.logprobs for p in params],
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_min_p=any(params[i].min_p > 0.0 for i in sampled),
            max_top_k=max((params[i].top_k for i in filt), default=0),
            any_top_p=any(params[i].top_p < 1.0 for i in filt),
            filter_rows=_index(filt, n, device),
            seeded_rows=seeded,
            shared_rows=_index([i for i in range(n) if i not in seeded_ids], n, device),
            max_num_logprobs=max(wanted, default=None),
        )
        freq_pres = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if freq_pres or rep:
            rows.presence_penalty, rows.frequency_penalty, rows.repetition_penalty = floats[3:]
        if freq_pres:
            outs = [output_token_ids[i] for i in freq_pres]
            rows.output_history = _pairs(freq_pres, [len(o) for o in outs], chain.from_iterable(outs), device)
        if rep:
            seqs = [(prompt_token_ids[i], output_token_ids[i]) for i in rep]
            lens = [len(p) + len(o) for p, o in seqs]
            rows.repetition_history = _pairs(rep, lens, chain.from_iterable(chain(*s) for s in seqs), device)
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        if biased:
            lens = [len(params[i].logit_bias) for i in biased]
            rows.bias = _pairs(biased, lens, chain.from_iterable(params[i].logit_bias for i in biased), device)
            values = list(chain.from_iterable(params[i].logit_bias.values() for i in biased))
            rows.bias_values = torch.tensor(values, dtype=torch.float32).to(device)
        ban = [i for i in range(n) if len(banned_token_ids[i])] if banned_token_ids is not None else []
        if ban:
            lens = [len(banned_token_ids[i]) for i in ban]
            rows.banned = _pairs(ban, lens, chain.from_iterable(banned_token_ids[i] for i in ban), device)
        return rows


@dataclass(slots=True)
class SampleResult:
    """One sampled token per row; the logprob fields are set when any row asked for logprobs."""

    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None = None  # [N, K] f32 top-K raw logprobs, descending
    logprob_token_ids: torch.Tensor | None = None  # [N, K] int64
    sampled_logprobs: torch.Tensor | None = None  # [N] f32 raw logprob of the sampled token
    sampled_ranks: torch.Tensor | None = None  # [N] int64, 1-based rank of the sampled token


class Sampler:
    """Samples one token per logits row; owns the shared generator of the rows without a seed."""

    def __init__(self, vocab_size: int, device: torch.device | str, seed: int):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: SamplingRows) -> SampleResult:
        """Samples from logits [N, V] (any float dtype; not modified) in the module's order."""
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [N, {self.vocab_size}], got {list(logits.shape)}")
        raw = None
        if rows.max_num_logprobs is not None:
            raw = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        x = self._penalized(logits, rows)
        if rows.all_greedy:
            tokens = x.argmax(dim=-1)
        else:
            greedy_tokens = x.argmax(dim=-1) if rows.any_greedy else None
            tokens = self._sample_random(x, rows)
            if greedy_tokens is not None:
                tokens = torch.where(rows.temperature == 0.0, greedy_tokens, tokens)
        if raw is None:
            return SampleResult(tokens)
        top, top_ids, sampled, ranks = token_logprobs(raw, tokens, rows.max_num_logprobs)
        return SampleResult(tokens, top, top_ids, sampled, ranks)

    def probs(self, logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        """The distribution `sample` draws each row from, as f32 probabilities [N, V]: one-hot at
        the argmax for greedy rows. Speculative verification compares drafts against it."""
        x = self._penalized(logits, rows)
        if rows.all_greedy:
            return torch.zeros_like(x).scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
        greedy = x.argmax(dim=-1, keepdim=True) if rows.any_greedy else None
        probs = self._filter(x, rows).softmax(dim=-1)
        if greedy is not None:
            one_hot = torch.zeros_like(probs).scatter_(1, greedy, 1.0)
            probs = torch.where((rows.temperature == 0.0).unsqueeze(1), one_hot, probs)
        return probs

    @staticmethod
    def _penalized(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        """Steps 1 and 2 of the module's order on an f32 copy of the logits."""
        x = apply_penalties(logits.to(torch.float32, copy=True), rows)
        if rows.bias is not None:
            x.index_put_((rows.bias[0], rows.bias[1]), rows.bias_values, accumulate=True)
        if rows.banned is not None:
            x[rows.banned[0], rows.banned[1]] = _NEG_INF
        return x

    def _sample_random(self, x: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        """Temperature, min_p, top-k, top-p, then the exponential race; overwrites x."""
        probs = self._filter(x, rows).softmax(dim=-1)
        return probs.div_(self.exponential(probs, rows)).argmax(dim=-1)

    def _filter(self, x: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        """Temperature, min_p, top-k and top-p on float logits x [N, V], in place."""
        t = rows.temperature
        x.div_(t.masked_fill(t == 0.0, 1.0).unsqueeze(1))
        if rows.any_min_p:  # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)
            floor = x.amax(dim=-1, keepdim=True) + rows.min_p.log().unsqueeze(1)
            x.masked_fill_(x < floor, _NEG_INF)
        if rows.max_top_k or rows.any_top_p:
            idx = rows.filter_rows
            if idx is None:
                _top_k_top_p(x, rows.top_k, rows.top_p if rows.any_top_p else None, rows.max_top_k)
            else:
                p = rows.top_p[idx] if rows.any_top_p else None
                x[idx] = _top_k_top_p(x[idx], rows.top_k[idx], p, rows.max_top_k)
        return x

    def exponential(self, like: torch.Tensor, rows: SamplingRows, offset: int = 0) -> torch.Tensor:
        """Exp(1) noise shaped like `like`; seeded rows get their keyed draws, for the token
        `offset` places after the one their key names (the seed invariant)."""
        q = torch.empty_like(like)
        if rows.shared_rows is None:
            q.exponential_(generator=self.generator)
        elif len(rows.shared_rows):
            shared = torch.empty((len(rows.shared_rows), q.shape[1]), dtype=q.dtype, device=q.device)
            q[rows.shared_rows] = shared.exponential_(generator=self.generator)
        if rows.seeded_rows:
            idx = torch.tensor([i for i, _ in rows.seeded_rows], device=q.device)
            q[idx] = keyed_exponential([k.at(offset) for _, k in rows.seeded_rows], q.shape[1], q.device).to(q.dtype)
        # NOTE: the CPU kernel can return exactly 0, and 0/0 is NaN, which argmax would pick.
        return q.clamp_min_(torch.finfo(q.dtype).tiny)


def token_logprobs(raw: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Of raw logprobs [N, V] and one token per row: (the top-k logprobs [N, k] descending, their
    ids, each token's own logprob [N], its rank [N], 1 = the most likely)."""
    own = raw.gather(1, tokens.unsqueeze(1))
    ranks = (raw > own).sum(dim=-1) + 1
    top = raw.topk(min(k, raw.shape[1]), dim=-1)
    return top.values, top.indices, own.squeeze(1), ranks


def apply_penalties(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Repetition (HF), then frequency and presence (OpenAI) penalties on float logits [N, V].

    Rows at the defaults (1, 0, 0) come back bit-identical. May modify and return `logits`.
    """
    if rows.repetition_history is not None:
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[rows.repetition_history[0], rows.repetition_history[1]] = True
        rp = rows.repetition_penalty.unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if rows.output_history is not None:
        r, t = rows.output_history
        counts = torch.zeros_like(logits)
        counts.index_put_((r, t), torch.ones_like(t, dtype=logits.dtype), accumulate=True)
        logits -= rows.frequency_penalty.unsqueeze(1) * counts
        logits -= rows.presence_penalty.unsqueeze(1) * (counts > 0)
    return logits


def _top_k_top_p(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor | None, max_top_k: int) -> torch.Tensor:
    """Masks x in place to each row's top-k (ties at the k-th value kept) and top-p nucleus.

    Top-k alone uses torch.topk; with top-p, one ascending sort. Each row keeps its max.
    """
    v = x.shape[1]
    k_off = (k <= 0) | (k >= v)
    if p is None:
        kth = x.topk(min(max_top_k, v), dim=-1).values.gather(1, (k.masked_fill(k_off, 1) - 1).unsqueeze(1))
        return x.masked_fill_(x < kth.masked_fill_(k_off.unsqueeze(1), _NEG_INF), _NEG_INF)
    s, order = x.sort(dim=-1)
    if max_top_k:
        kth = s.gather(1, (v - k.masked_fill(k_off, v)).unsqueeze(1))
        s.masked_fill_(s < kth, _NEG_INF)
    drop = s.softmax(dim=-1).cumsum_(dim=-1) <= (1.0 - p).unsqueeze(1)
    drop[:, -1] = False
    return x.scatter_(1, order, s.masked_fill_(drop, _NEG_INF))


def _index(rows: list[int], n: int, device: torch.device | str) -> torch.Tensor | None:
    """Row indices as a tensor, or None when they are all n rows (index nothing)."""
    return None if len(rows) == n else torch.tensor(rows, dtype=torch.int64, device=device)


def _pairs(
    rows: list[int], lens: list[int], tokens: Iterable[int], device: torch.device | str
) -> torch.Tensor:
    """[2, M] int64 (row, token) pairs: row rows[j] repeated lens[j] times beside its tokens."""
    out = np.empty((2, sum(lens)), dtype=np.int64)
    out[0] = np.repeat(np.asarray(rows, dtype=np.int64), lens)
    out[1] = np.fromiter(tokens, dtype=np.int64, count=out.shape[1])
    return torch.from_numpy(out).to(device)
