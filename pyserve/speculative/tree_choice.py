"""Token trees or one chain: chosen per batch-size bucket by what each measured, not assumed.

A tree keeps more guesses a step than a chain, and costs more: its verification rows, and the
head's growth, which feeds several candidates a depth (on a CPU, op by op, where a chain's greedy
guesses are one kernel call). Which pays depends on the model, the device and the batch, so the
Speculator times both: a cycle is a proposal and the step that verifies it, and its rate is the
tokens that step produced over the two's seconds. Each bucket first takes EXPLORE_CYCLES cycles of
each way, alternating, then the way with the higher weighted mean rate, with a cycle of the other
way every RECHECK_EVERY choices (text and load change). No torch here.
"""

from __future__ import annotations

from pyserve.speculative.depth import DECAY, bucket_of

EXPLORE_CYCLES = 4  # per way, before the rates decide
RECHECK_EVERY = 32  # choices between two cycles of the way not chosen


class TreeChoice:
    def __init__(self) -> None:
        # bucket -> per way (False: chain, True: tree) [weighted tokens, weighted seconds, cycles]
        self.buckets: dict[int, dict[bool, list[float]]] = {}
        self.choices: dict[int, int] = {}

    def _ways(self, batch_size: int) -> dict[bool, list[float]]:
        key = bucket_of(batch_size)
        ways = self.buckets.get(key)
        if ways is None:
            ways = self.buckets[key] = {False: [0.0, 0.0, 0], True: [0.0, 0.0, 0]}
        return ways

    def observe(self, batch_size: int, tree: bool, tokens: int, seconds: float) -> None:
        """A cycle's proposal (a tree or a chain) and verification step produced `tokens` in `seconds`."""
        way = self._ways(batch_size)[tree]
        way[0] = DECAY * way[0] + tokens
        way[1] = DECAY * way[1] + seconds
        way[2] += 1

    def rate(self, batch_size: int, tree: bool) -> float:
        """Tokens per second of the way's recent cycles (0 before any)."""
        tokens, seconds, _ = self._ways(batch_size)[tree]
        return tokens / seconds if seconds > 0 else 0.0

    def trees(self, batch_size: int) -> bool:
        """Whether the next proposal at this batch size grows trees."""
        ways = self._ways(batch_size)
        if min(ways[False][2], ways[True][2]) < EXPLORE_CYCLES:
            return ways[True][2] <= ways[False][2]
        key = bucket_of(batch_size)
        self.choices[key] = self.choices.get(key, 0) + 1
        better = self.rate(batch_size, True) > self.rate(batch_size, False)
        return not better if self.choices[key] % RECHECK_EVERY == 0 else better
