"""Token trees (EAGLE-2's dynamic trees): how a tree is grown and which drafts it keeps, the
head's attention over each candidate's own path, the verification's walk (greedy and exact in
distribution when sampled), the kept path's KV moved to its place, and whole engines whose
outputs equal plain decoding with trees on every step."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pyserve import LLM, SamplingParams
from pyserve.default_model import HEAD_DIR, TARGET_DIR
from pyserve.speculative.config import DEFAULT_TREE_NODES, SpeculativeConfig
from pyserve.speculative.depth import EXPLORE_NODE_PRICE, DepthController
from pyserve.speculative.eagle_tree import ALL_BITS, grow_trees
from pyserve.speculative.proposer import DraftTree, row_depths
from pyserve.speculative.tree_choice import EXPLORE_CYCLES, RECHECK_EVERY, TreeChoice
from pyserve.speculative.verify import Verifier
from pyserve.step.request import StepResult, StepRows

PROMPTS = ["def parse_price(text):\n    \"\"\"Return the amount in cents of a price such as '$12.50'.\"\"\"\n",
           "class ShoppingCart:\n    def __init__(self):\n        self.items = {}\n\n    def add(self, sku, quantity=1):\n",
           "def moving_average(values, window):\n    if window <= 0:\n",
           "import os\n\n\ndef walk(path):\n"]
TREES = {"method": "eagle3", "num_speculative_tokens": 3, "adaptive": False, "tree_nodes": 12}


class FakeHead:
    """A head whose output is the token it was fed (the root: 0) and whose likeliest children of
    token t are 10 t + 1 (p 0.7) and 10 t + 2 (p 0.3)."""

    def __init__(self):
        self.calls = []

    def forward(self, hidden, tokens, positions, slots, requests, masks):
        self.calls.append((tokens.tolist(), positions.tolist(), slots.tolist(), [int(m) for m in masks]))
        return torch.tensor(tokens, dtype=torch.float32)[:, None]

    @staticmethod
    def top_children(hidden, width):
        t = hidden[:, 0].long().numpy()
        tokens = np.stack([10 * t + 1, 10 * t + 2], axis=1)[:, :width]
        return tokens, np.log(np.array([[0.7, 0.3]] * len(t)))[:, :width]


def test_a_tree_keeps_its_likeliest_chain_first_then_the_drafts_worth_a_row():
    head = FakeHead()
    trees = grow_trees(head.forward, head.top_children, torch.zeros(1, 1), np.array([20]), np.array([3]),
                       np.array([50]), price=0.2, max_nodes=8, width=2)
    # Candidates: 1 (.7) 2 (.3); 11 (.49) 12 (.21) 21 (.21) 22 (.09); 111 (.343) 112 (.147) 121 ...
    # Kept: the chain 1, 11, 111, then 2, 12, 21 (above .2), each after its parent.
    assert trees == [DraftTree([1, 11, 111, 2, 12, 21], [0, 1, 2, 0, 1, 4])]
    assert row_depths(np.array([-1, *trees[0].parents])).max() == 3
    # Fed: depth 1's two candidates at position 21, slots 21 and 22; then depth 2's best two (11,
    # 12) at position 22, slots 23 and 24. Each sees itself, its fed ancestors and the keys
    # before slot 21: 11 (slot 23) sees 1 (two back), not 2 (one back).
    assert [c[:3] for c in head.calls] == [([1, 2], [21, 21], [21, 22]), ([11, 12], [22, 22], [23, 24])]
    assert head.calls[0][3] == [ALL_BITS, ALL_BITS ^ 0b10]
    assert head.calls[1][3] == [ALL_BITS ^ 0b10, ALL_BITS ^ 0b110]
    # Fewer nodes allowed, or a higher price: fewer drafts off the chain; the chain stays.
    head = FakeHead()
    assert grow_trees(head.forward, head.top_children, torch.zeros(1, 1), np.array([20]), np.array([3]),
                      np.array([50]), price=0.2, max_nodes=4, width=2) == [DraftTree([1, 11, 111, 2], [0, 1, 2, 0])]
    assert grow_trees(head.forward, head.top_children, torch.zeros(1, 1), np.array([20]), np.array([3]),
                      np.array([50]), price=0.5, max_nodes=8, width=2) == [[1, 11, 111]]
    # No room for slots past the newest pair: depth 1 only (nothing fed).
    head = FakeHead()
    assert grow_trees(head.forward, head.top_children, torch.zeros(1, 1), np.array([20]), np.array([3]),
                      np.array([0]), price=0.2, max_nodes=8, width=2) == [DraftTree([1, 2], [0, 0])]
    assert head.calls == []


def _tree_step(parents, tokens):
    """A step where request 0 verifies a token tree (rows: its last token, then `tokens`)."""
    n = len(parents)
    return SimpleNamespace(tree_parents=np.array(parents, dtype=np.int32), query_start_loc=np.array([0, n]),
                           num_logits=np.array([n]), input_ids=np.array([5, *tokens], dtype=np.int32),
                           logits_indices=np.arange(n, dtype=np.int32))


def _request(greedy=True):
    return SimpleNamespace(internal_id=1, params=SimpleNamespace(greedy=greedy))


def test_the_greedy_walk_follows_the_targets_argmax_through_the_tree():
    # Rows: 0 its last token; 1 (token 7) and 2 (token 8) follow it; 3 (token 9) follows 2.
    out = _tree_step([-1, 0, 0, 2], [7, 8, 9])
    vocab = 12
    logits = torch.zeros(4, vocab)
    for row, best in enumerate([8, 3, 9, 4]):  # the target: 8 after row 0, 9 after row 2, then 4
        logits[row, best] = 5.0

    def argmax(rows_logits, rows):
        return StepResult(rows_logits.argmax(-1).numpy(), np.ones(len(rows.requests), dtype=np.int64))

    verifier = Verifier(sampler=None, device=torch.device("cpu"), proposer=None, seed_of=lambda r: None)
    rows = StepRows([_request()], [10])
    result = verifier.sample_and_verify(out, logits, rows, np.array([4]), argmax)
    assert result.token_ids.tolist() == [8, 9, 4] and result.num_sampled.tolist() == [3]
    assert result.tree_paths[0].tolist() == [0, 2, 3]  # the kept rows: their KV goes to rows 0, 1, 2
    logits[0] = 0.0
    logits[0, 6] = 5.0  # no child holds the target's token: only it
    result = verifier.sample_and_verify(out, logits, rows, np.array([4]), argmax)
    assert result.token_ids.tolist() == [6] and result.tree_paths[0].tolist() == [0]


def test_a_sampled_walk_gives_the_targets_distribution():
    """Each row sampled from the target (as plain sampling would), the walk's first token follows
    the root's distribution and the second the child's, whichever children the tree held."""
    out = _tree_step([-1, 0, 0], [0, 1])  # children: tokens 0 and 1
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    generator = torch.Generator().manual_seed(0)

    def draw(rows_logits, rows):
        tokens = torch.multinomial(torch.softmax(rows_logits, -1), 1, generator=generator)[:, 0]
        return StepResult(tokens.numpy(), np.ones(len(rows.requests), dtype=np.int64))

    verifier = Verifier(sampler=None, device=torch.device("cpu"), proposer=None, seed_of=lambda r: None)
    rows = StepRows([_request(greedy=False)], [10])
    first, second = np.zeros(4), np.zeros((2, 4))
    trials = 6000
    for _ in range(trials):
        tokens = verifier.sample_and_verify(out, probs.log(), rows, np.array([3]), draw).token_ids
        first[tokens[0]] += 1
        if tokens[0] < 2:
            assert len(tokens) == 2
            second[tokens[0], tokens[1]] += 1
        else:
            assert len(tokens) == 1
    np.testing.assert_allclose(first / trials, probs[0].numpy(), atol=0.025)
    np.testing.assert_allclose(second[0] / second[0].sum(), probs[1].numpy(), atol=0.04)
    np.testing.assert_allclose(second[1] / second[1].sum(), probs[2].numpy(), atol=0.04)


@pytest.fixture
def trees_everywhere(monkeypatch):
    """Every proposal grows a tree, and every candidate above price 0 is worth a row: each is
    as wide as allowed."""
    monkeypatch.setattr(TreeChoice, "trees", lambda self, batch_size: True)
    monkeypatch.setattr(DepthController, "node_price", lambda self, *a: 0.0)
    import pyserve.worker.model_worker as worker

    moved = []
    move = worker.move_slots
    monkeypatch.setattr(worker, "move_slots", lambda caches, src, dst: moved.append(len(src)) or move(caches, src, dst))
    return moved


def outputs(llm, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_outputs_with_trees_equal_plain_decoding(trees_everywhere):
    """The shipped head, trees of up to 12 drafts on every step, a mixed batch with prompts in
    32-token chunks and a repeated prompt (prefix cache): plain decoding's tokens, paths off the
    chain kept (their KV moved) and per-depth counters; then a KV pool small enough to preempt."""
    prompts = PROMPTS + PROMPTS[:1]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=32)
    with LLM(str(TARGET_DIR), **engine) as llm:
        plain = outputs(llm, prompts, greedy)
    with LLM(str(TARGET_DIR), speculative_config=TREES, **engine) as llm:
        assert outputs(llm, prompts, greedy) == plain
        stats = llm.stats()
    assert stats["spec_decode_num_trees"] > 20
    assert stats["spec_decode_num_tree_nodes"] > 6 * stats["spec_decode_num_trees"]
    assert sum(trees_everywhere) > 0, "no kept path lay off the chain"
    drafted = stats["spec_decode_num_draft_tokens_per_pos"]
    assert len(drafted) == 3 and drafted[0] == stats["spec_decode_num_drafts"]
    assert stats["spec_decode_mean_acceptance_length"] > 2.0
    with LLM(str(TARGET_DIR), speculative_config=TREES, block_size=4, num_kv_blocks=40) as llm:  # preempts
        assert outputs(llm, prompts, greedy) == plain
        assert llm.stats()["num_preemptions"] > 0 and llm.stats()["spec_decode_num_trees"] > 0


def test_seeded_and_unseeded_samples_with_trees(trees_everywhere):
    """Seeded requests (n=2) give plain sampling's tokens; unseeded ones finish their tokens."""
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, ignore_eos=True, seed=7, n=2),
              SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=3)]
    engine = dict(block_size=4, num_kv_blocks=256)
    with LLM(str(TARGET_DIR), **engine) as llm:
        plain = outputs(llm, PROMPTS[:2], seeded)
    with LLM(str(TARGET_DIR), speculative_config=TREES, **engine) as llm:
        assert outputs(llm, PROMPTS[:2], seeded) == plain
        free = outputs(llm, PROMPTS[2:], SamplingParams(temperature=0.7, max_tokens=24, ignore_eos=True))
        assert llm.stats()["spec_decode_num_trees"] > 0
    assert [len(c) for o in free for c in o] == [24, 24]


def test_constrained_requests_verify_trees_masked_path_by_path(trees_everywhere):
    """JSON-schema and regex requests beside a free one, trees on every step: each row masked
    as the grammar stands after its own path; the tokens are plain decoding's."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
              "required": ["name", "size"], "additionalProperties": False}
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json": schema}),
              SamplingParams(temperature=0.0, max_tokens=24, structured_outputs={"regex": r"def [a-z_]+\(x\):"}),
              SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)]
    engine = dict(block_size=4, num_kv_blocks=256)
    with LLM(str(TARGET_DIR), **engine) as llm:
        plain = outputs(llm, PROMPTS[:3], params)
    with LLM(str(TARGET_DIR), speculative_config=TREES, **engine) as llm:
        got = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        stats = llm.stats()
    assert [[c.token_ids for c in o.outputs] for o in got] == plain
    assert set(json.loads(got[0].outputs[0].text)) == {"name", "size"}
    assert stats["spec_decode_num_trees"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0


def test_tree_nodes_is_eagle3s_and_bounded():
    assert SpeculativeConfig.parse({"method": "eagle3"}, {"eagle3": str(HEAD_DIR)}).tree_nodes == DEFAULT_TREE_NODES
    assert SpeculativeConfig.parse({"method": "ngram"}).tree_nodes == 0
    with pytest.raises(ValueError, match="tree_nodes is only for the method eagle3"):
        SpeculativeConfig.parse({"method": "ngram", "tree_nodes": 8})
    with pytest.raises(ValueError, match="tree_nodes must be an integer from 0 to 63"):
        SpeculativeConfig.parse({"method": "eagle3", "tree_nodes": 64}, {"eagle3": str(HEAD_DIR)})


def test_the_price_of_a_row_follows_the_measured_step_costs():
    """Before a step with drafts was timed: the exploring price; then b * tokens / seconds of a
    step at the depth, so dearer rows ask more of a draft."""
    cheap, dear = DepthController(4), DepthController(4)
    assert cheap.node_price(1, 1, 3) == EXPLORE_NODE_PRICE
    for c, slope in ((cheap, 0.0001), (dear, 0.004)):
        for drafts in [0, 0, 0, 2, 2, 4, 4, 8, 8, 3, 6]:  # a shape's first step is a warm-up
            c.observe_step(1, drafts, 0.01 + slope * drafts)
    low, high = cheap.node_price(1, 1, 3), dear.node_price(1, 1, 3)
    assert 0 < low < high <= 1.0
    a, b = dear._bucket(1).spec_line()
    assert math.isclose(b, 0.004, rel_tol=1e-6)


def test_trees_or_chains_by_the_rate_each_measured():
    choice = TreeChoice()
    seen = []
    for _ in range(2 * EXPLORE_CYCLES):  # alternating, trees first
        tree = choice.trees(1)
        seen.append(tree)
        choice.observe(1, tree, 3 if tree else 2, 0.010)  # trees: 300 tok/s, chains: 200
    assert seen == [True, False] * EXPLORE_CYCLES
    picks = [choice.trees(1) for _ in range(2 * RECHECK_EVERY)]
    assert picks.count(False) == 2 and picks[RECHECK_EVERY - 2] and picks[RECHECK_EVERY - 1] is False
    assert choice.trees(16) is True  # another bucket explores on its own
    for _ in range(40):  # trees got dearer: chains win from then on
        choice.observe(1, True, 3, 0.030)
    assert choice.rate(1, True) < choice.rate(1, False)
    assert [choice.trees(1) for _ in range(5)].count(False) >= 4
