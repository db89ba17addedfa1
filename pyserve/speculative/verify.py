"""Verification of speculative drafts: a step's rows that scored drafts keep the drafts the target
accepts, then one more token from the target (greedy: the target's argmax), so the output follows
the target's distribution. Unseeded requests by exact rejection sampling; seeded ones by their
keyed noise, coupled (which makes their output plain sampling's token for token). Rows without drafts go
through the plain sampler. A token tree is verified by a walk: every row of the tree is sampled as
plain decoding would sample that token (greedy: the argmax; seeded: its keyed noise; unseeded: fresh
noise), and from the request's last token the walk follows the child equal to the target's token
while there is one; the target's token at the last node kept comes after. Each token is then the
target's own sample given the tokens before it, whatever the tree held: exact for any tree (the
chance to go on is the target's mass on the children), where rejection sampling with several
children would need children drawn independently from the draft. Runs in the worker, on the step's
logits."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pyserve.step.request import EngineRequest, StepResult, StepRows
from pyserve.kernels.rejection_sample import rejection_sample, rejection_sample_ref
from pyserve.model.sampler import Sampler, SamplingRows
from pyserve.speculative.proposer import ModelProposer, row_depths, tree_parents_of


class Verifier:
    def __init__(self, sampler: Sampler, device: torch.device, proposer: ModelProposer | None,
                 seed_of: Callable[[EngineRequest], int | None]):
        self.sampler = sampler
        self.device = device
        self.proposer = proposer  # a draft model keeps the distributions its drafts came from
        self.seed_of = seed_of  # a request's noise seed (None: unseeded or greedy)

    def warm_up(self) -> None:
        """Launches the rejection kernel once (with or without draft distributions, as this
        engine verifies) so that its compile does not land on a request."""
        vocab, dev = self.sampler.vocab_size, self.device
        p = torch.full((2, vocab), 1.0 / vocab, device=dev)
        ids = torch.zeros(2, dtype=torch.int64, device=dev)
        rejection_sample(p, p if self.proposer is not None else None, ids, ids, ids,
                         torch.zeros(1, dtype=torch.int32, device=dev), torch.tensor([0, 2], dtype=torch.int32, device=dev))

    def sample_and_verify(self, out, logits: torch.Tensor, rows: StepRows, counts: np.ndarray,
                          sample: Callable[[torch.Tensor, StepRows], StepResult],
                          certain: frozenset[int] = frozenset()) -> StepResult:
        """Rows with drafts (count > 1) go through rejection sampling, except those whose drafts
        are certain (`certain` holds their first logits rows: a grammar left each draft the only
        token), which keep their drafts and sample the row after them; the other rows go
        through the plain `sample`. Tokens come back end to end, `num_sampled[i]` for
        rows.requests[i]."""
        reqs = rows.requests
        offsets = np.concatenate([[0], np.cumsum(counts)])
        sure = np.array([c > 1 and int(o) in certain for c, o in zip(counts, offsets[:-1])], dtype=bool)
        tree_parents = [tree_parents_of(out, seq) for seq in np.flatnonzero(out.num_logits > 0).tolist()]
        tree = np.array([p is not None for p in tree_parents], dtype=bool)
        plain = np.flatnonzero((counts == 1) | sure)
        spec = np.flatnonzero((counts > 1) & ~sure & ~tree)
        per_row: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(reqs)
        plain_result = None
        if len(plain):
            kept = counts[plain] - 1  # certain drafts before the row each samples
            taken = rows.take(plain)
            taken.num_output = [n + int(k) for n, k in zip(taken.num_output, kept)]
            plain_result = sample(logits[torch.from_numpy(offsets[plain] + kept).to(self.device)], taken)
            for j, i in enumerate(plain):
                drafts = out.input_ids[out.logits_indices[offsets[i] + 1 : offsets[i + 1]]]
                per_row[i] = np.concatenate([drafts.astype(np.int64), plain_result.token_ids[j : j + 1]])
                if kept[j] and self.proposer is not None:
                    self.proposer.take_draft_probs(reqs[i].internal_id, int(kept[j]))
                    self.proposer.accepted(reqs[i].internal_id, int(kept[j]))
        if len(spec):
            spec_rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in spec])
            if all(reqs[i].params.greedy for i in spec):
                accepted = self._verify_greedy(out, logits, reqs, counts, spec, spec_rows)
            else:
                accepted = self._verify(out, logits, reqs, counts, spec, spec_rows)
            for i, tokens in zip(spec, accepted):
                per_row[i] = tokens
        paths = None
        if tree.any():
            walked = self._walk_trees(out, logits, rows, offsets, np.flatnonzero(tree), tree_parents, sample)
            for i, (_, tokens) in walked.items():
                per_row[i] = tokens
            paths = {i: kept for i, (kept, _) in walked.items()}
        num_sampled = np.array([len(t) for t in per_row], dtype=np.int64)
        result = StepResult(token_ids=np.concatenate(per_row), num_sampled=num_sampled, tree_paths=paths)
        if plain_result is not None and plain_result.logprobs is not None:
            # Where each plain row's sampled token sits (rows with drafts never ask for logprobs).
            at = np.cumsum(num_sampled)[plain] - 1
            result.logprobs = plain_result.logprobs.scattered(at, int(num_sampled.sum()))
        return result

    def _walk_trees(self, out, logits, rows: StepRows, offsets, trees, tree_parents, sample
                    ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per request row of `trees`: (the step rows it kept, its tokens), by the walk (module
        doc). Every tree row's token in one call of `sample`, row j of a request keyed as its
        output token num_output + depth(j)."""
        logit_rows, requests, num_output = [], [], []
        for i in trees.tolist():
            parents = tree_parents[i]
            logit_rows.append(np.arange(offsets[i], offsets[i + 1]))
            requests += [rows.requests[i]] * len(parents)
            num_output += (rows.num_output[i] + row_depths(parents)).tolist()
        picked = sample(logits[torch.from_numpy(np.concatenate(logit_rows)).to(self.device)],
                        StepRows(requests, num_output)).token_ids
        results = {}
        start = 0
        for i in trees.tolist():
            parents = tree_parents[i]
            targets = picked[start : start + len(parents)]
            start += len(parents)
            drafts = out.input_ids[out.logits_indices[offsets[i] : offsets[i + 1]]]
            path = [0]
            while True:
                node = path[-1]
                child = next((j for j in range(node + 1, len(parents))
                              if parents[j] == node and drafts[j] == targets[node]), None)
                if child is None:
                    break
                path.append(child)
            kept = np.asarray(path, dtype=np.int64)
            results[i] = (kept, np.concatenate([drafts[kept[1:]].astype(np.int64), targets[path[-1] : path[-1] + 1]]))
            if self.proposer is not None:
                self.proposer.take_draft_probs(rows.requests[i].internal_id, len(parents) - 1)
                self.proposer.accepted(rows.requests[i].internal_id, len(path) - 1)
        return results

    @staticmethod
    def _drafts(out, counts, spec, spec_rows) -> tuple[np.ndarray, np.ndarray]:
        """(the draft each logits row of `spec_rows` verifies, -1 on a request's last row; the
        requests' row offsets). Row r verifies the input token after its own position."""
        drafts = np.full(len(spec_rows), -1, dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(counts[spec])]).astype(np.int32)
        for j in range(len(spec)):
            positions = out.logits_indices[spec_rows[cu[j] : cu[j + 1]]]
            drafts[cu[j] : cu[j + 1] - 1] = out.input_ids[positions[1:]]
        return drafts, cu

    def _verify_greedy(self, out, logits, rows, counts, spec, spec_rows) -> list[np.ndarray]:
        """Rejection sampling when every target is one-hot: drafts are kept while they equal the
        target's argmax, then comes the argmax. The draft model's q plays no part."""
        best = logits[torch.from_numpy(spec_rows).to(self.device)].argmax(dim=-1).cpu().numpy()
        drafts, cu = self._drafts(out, counts, spec, spec_rows)
        accepted = []
        for j, i in enumerate(spec):
            lo, hi = int(cu[j]), int(cu[j + 1])
            wrong = np.flatnonzero(drafts[lo : hi - 1] != best[lo : hi - 1])
            num_accepted = int(wrong[0]) if len(wrong) else hi - 1 - lo
            accepted.append(best[lo : lo + num_accepted + 1])
            if self.proposer is not None:
                self.proposer.take_draft_probs(rows[i].internal_id, int(counts[i]) - 1)
                self.proposer.accepted(rows[i].internal_id, num_accepted)
        return accepted

    def _verify(self, out, logits, rows, counts, spec, spec_rows) -> list[np.ndarray]:
        """Accepted drafts plus one token, per request of `spec`, in one call of the rejection
        sampler. A seeded request is coupled, its rows keyed by its seed and the token index each
        samples (what plain sampling reads there, see model.noise); the others are keyed by a
        seed drawn for this step from the shared generator and their row."""
        dev = self.device
        params = [rows[i].params for i in spec for _ in range(counts[i])]
        sampling = SamplingRows.build(params, [None] * len(params), [[]] * len(params), [[]] * len(params), None, dev)
        target = self.sampler.probs(logits[torch.from_numpy(spec_rows).to(dev)], sampling)
        drafts, cu = self._drafts(out, counts, spec, spec_rows)
        step_seed = int(torch.randint(0, 2**62, (1,), generator=self.sampler.generator, device=dev))
        request_seeds = [self.seed_of(rows[i]) for i in spec]
        row_request = np.repeat(np.arange(len(spec)), np.diff(cu))
        token_index = out.positions[out.logits_indices[spec_rows]] + 1  # the index each row samples
        own = np.array([s is not None for s in request_seeds])
        seeds = np.where(own[row_request], [request_seeds[j] or 0 for j in row_request], step_seed).astype(np.int64)
        positions = np.where(own[row_request], token_index, np.arange(len(spec_rows))).astype(np.int64)
        draft_probs = None
        if self.proposer is not None:
            zero = torch.zeros((1, target.shape[1]), device=dev)
            qs = []
            for j, i in enumerate(spec):
                q = self.proposer.take_draft_probs(rows[i].internal_id, int(counts[i]) - 1)
                if q is None:  # drafts that are not the draft model's (a grammar's forced tokens): certain guesses
                    q = torch.zeros((int(counts[i]) - 1, target.shape[1]), device=dev)
                    q[torch.arange(len(q), device=dev), torch.from_numpy(drafts[cu[j] : cu[j + 1] - 1]).to(dev)] = 1.0
                qs += [q, zero]
            draft_probs = torch.cat(qs)
        verify = rejection_sample if dev.type == "cuda" else rejection_sample_ref
        tokens, num = verify(target, draft_probs, torch.from_numpy(drafts).to(dev), torch.from_numpy(seeds).to(dev),
                             torch.from_numpy(positions).to(dev), torch.from_numpy(own.astype(np.int32)).to(dev),
                             torch.from_numpy(cu).to(dev))
        tokens, num = tokens.cpu().numpy(), num.cpu().numpy()
        if self.proposer is not None:
            for j, i in enumerate(spec):
                self.proposer.accepted(rows[i].internal_id, int(num[j]) - 1)
        return [tokens[cu[j] : cu[j] + num[j]] for j in range(len(spec))]
