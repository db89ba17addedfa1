"""The pyserve scheduling policy in plain Python: a benchmark baseline, not the product.

Written like a classic Python engine (request objects in a dict, a deque free list and refcount
list, numpy arrays built from lists at the end of the step), with the same policy and the same
flat outputs as pyserve._core.Scheduler. Not supported: priorities, LoRA, drafts, forks, stop
tokens other than one EOS id. Prefix cache: a dict keyed by the tuple of all tokens up to the end
of each full block; unreferenced cached blocks are evicted LRU (blocks are released tail first).
"""

from bisect import insort
from collections import OrderedDict, deque

import numpy as np

WAITING, RUNNING, PREEMPTED, FINISHED = "waiting", "running", "preempted", "finished"


class Request:
    def __init__(self, request_id, prompt_token_ids, max_tokens, eos_token_id, order):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_inserted_blocks = 0
        self.max_tokens = max_tokens
        self.eos_token_id = eos_token_id
        self.order = order  # queue position; negative once preempted (back to the head)
        self.status = WAITING


class SchedulerOutput:
    """One step's flat arrays, with the same names and dtypes as pyserve._core.SchedulerOutput."""

    def __init__(self, **arrays):
        self.__dict__.update(arrays)
        self.num_reqs = len(self.req_ids)
        self.total_num_tokens = len(self.input_ids)

    def __len__(self):
        return self.num_reqs


class PyScheduler:
    def __init__(self, *, num_blocks, block_size=16, max_num_batched_tokens=2048, max_num_seqs=256,
                 max_model_len=4096, enable_prefix_caching=True):
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks = deque(range(1, num_blocks))  # block 0 is the null (padding) block
        self.ref_counts = [0] * num_blocks
        self.cached = {}  # tuple of tokens up to the end of a full block -> block
        self.block_keys = {}  # cached block -> its key
        self.evictable = OrderedDict()  # unreferenced cached blocks, least recently used first
        self.requests = {}
        self.waiting = deque()
        self.running = []
        self.next_order = 0
        self.next_head_order = -1
        self.in_flight = None
        self.finished_since_step = []
        self.step = 0

    # Block pool and prefix cache.

    def _blocks_for(self, num_tokens):
        return -(-num_tokens // self.block_size)

    def _num_allocatable(self):
        return len(self.free_blocks) + len(self.evictable)

    def _alloc_block(self):
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_keys.pop(block)]
        self.ref_counts[block] = 1
        return block

    def _take_ref(self, block):
        self.ref_counts[block] += 1
        self.evictable.pop(block, None)

    def _release(self, block):
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self.block_keys:
                self.evictable[block] = None
            else:
                self.free_blocks.appendleft(block)

    def _can_allocate(self, req, hits, num_slots):
        needed = max(0, self._blocks_for(num_slots) - len(req.block_table) - len(hits))
        revived = sum(1 for b in hits if self.ref_counts[b] == 0) if hits else 0
        return needed + revived <= self._num_allocatable()

    def _allocate_slots(self, req, hits, num_slots):
        if not self._can_allocate(req, hits, num_slots):
            return False
        for block in hits:
            self._take_ref(block)
            req.block_table.append(block)
        for _ in range(self._blocks_for(num_slots) - len(req.block_table)):
            req.block_table.append(self._alloc_block())
        return True

    def _free(self, req):
        for block in reversed(req.block_table):  # tail first: evicted before its prefix
            self._release(block)
        req.block_table = []
        req.num_inserted_blocks = 0

    def _match_prefix(self, req):
        hits = []
        if self.enable_prefix_caching:
            bs, tokens = self.block_size, req.token_ids
            for i in range((len(tokens) - 1) // bs):
                block = self.cached.get(tuple(tokens[:(i + 1) * bs]))
                if block is None:
                    break
                hits.append(block)
        return hits

    def _cache_full_blocks(self, req):
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(min(req.num_computed_tokens, len(req.token_ids)) // bs, len(req.block_table))
        for i in range(req.num_inserted_blocks, full):
            key = tuple(req.token_ids[:(i + 1) * bs])
            own = req.block_table[i]
            block = self.cached.get(key)
            if block is None:
                self.cached[key] = own
                self.block_keys[own] = key
            elif block != own:  # identical block already cached: share it
                self._take_ref(block)
                self._release(own)
                req.block_table[i] = block
        req.num_inserted_blocks = max(req.num_inserted_blocks, full)

    # Requests and steps.

    def add_request(self, request_id, prompt_token_ids, *, max_tokens=None, eos_token_id=None):
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_token_ids)
        req = Request(request_id, prompt_token_ids, max_tokens, eos_token_id, self.next_order)
        self.next_order += 1
        self.requests[request_id] = req
        self.waiting.append(req)

    def _preempt(self, req):
        self._free(req)
        req.num_computed_tokens = 0
        req.status = PREEMPTED
        req.order = self.next_head_order
        self.next_head_order -= 1
        self.waiting.appendleft(req)

    def schedule(self):
        assert self.in_flight is None, "the previous step has not been updated"
        budget = self.max_num_batched_tokens
        plan = []  # (request, num_new_tokens, start, num_logits)
        preempted = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            start = req.num_computed_tokens
            num_new = min(len(req.token_ids) - start, budget)
            if num_new == 0:
                i += 1
                continue
            while not self._can_allocate(req, (), start + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RUNNING:
                break
            self._allocate_slots(req, (), start + num_new)
            plan.append((req, num_new, start, 1 if start + num_new >= len(req.token_ids) else 0))
            budget -= num_new
            i += 1

        while not preempted and budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits = self._match_prefix(req)
            cached = len(hits) * self.block_size
            num_new = min(len(req.token_ids) - cached, budget)
            if not self._allocate_slots(req, hits, cached + num_new):
                break
            self.waiting.popleft()
            req.num_computed_tokens = cached
            req.status = RUNNING
            insort(self.running, req, key=lambda r: r.order)
            plan.append((req, num_new, cached, 1 if cached + num_new >= len(req.token_ids) else 0))
            budget -= num_new

        bs = self.block_size
        req_ids, num_tokens, query_start_loc, seq_lens = [], [], [0] if plan else [], []
        input_ids, positions, slot_mapping, logits_indices, tables = [], [], [], [], []
        for req, n, start, num_logits in plan:
            table = req.block_table
            input_ids.extend(req.token_ids[start:start + n])
            for pos in range(start, start + n):
                positions.append(pos)
                slot_mapping.append(table[pos // bs] * bs + pos % bs)
            if num_logits:
                logits_indices.append(len(input_ids) - 1)
            req_ids.append(req.request_id)
            num_tokens.append(n)
            query_start_loc.append(len(input_ids))
            seq_lens.append(start + n)
            tables.append(table)
            req.num_computed_tokens = start + n
        width = max((len(t) for t in tables), default=0)
        out = SchedulerOutput(
            step=self.step,
            req_ids=np.array(req_ids, dtype=np.uint64),
            num_scheduled_tokens=np.array(num_tokens, dtype=np.int32),
            num_logits=np.array([p[3] for p in plan], dtype=np.int32),
            logits_indices=np.array(logits_indices, dtype=np.int32),
            query_start_loc=np.array(query_start_loc, dtype=np.int32),
            seq_lens=np.array(seq_lens, dtype=np.int32),
            input_ids=np.array(input_ids, dtype=np.int32),
            positions=np.array(positions, dtype=np.int64),
            slot_mapping=np.array(slot_mapping, dtype=np.int64),
            block_tables=np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
            .reshape(len(tables), width),
            preempted_req_ids=np.array(preempted, dtype=np.uint64),
            finished_req_ids=np.array(self.finished_since_step, dtype=np.uint64),
        )
        self.finished_since_step = []
        self.in_flight = plan
        self.step += 1
        return out

    def update(self, sampled_token_ids, num_sampled):
        """Appends each request's sampled tokens (laid end to end) and finishes requests that hit
        max_tokens, the model length or EOS. Returns the finished request ids."""
        plan, self.in_flight = self.in_flight, None
        sampled = np.asarray(sampled_token_ids).tolist()
        counts = np.asarray(num_sampled).tolist()
        assert len(counts) == len(plan) and sum(counts) == len(sampled)
        finished = []
        offset = 0
        for (req, _, _, num_logits), n in zip(plan, counts):
            assert n <= num_logits
            for token in sampled[offset:offset + n]:
                req.token_ids.append(token)
                num_out = len(req.token_ids) - req.num_prompt_tokens
                if (token == req.eos_token_id or num_out >= req.max_tokens
                        or len(req.token_ids) >= self.max_model_len):
                    req.status = FINISHED
                    break
            offset += n
            self._cache_full_blocks(req)
            if req.status == FINISHED:
                self._free(req)
                del self.requests[req.request_id]
                finished.append(req.request_id)
        if finished:
            self.running = [r for r in self.running if r.status == RUNNING]
            self.finished_since_step.extend(finished)
        return finished

    def has_unfinished_requests(self):
        return bool(self.requests)
