"""How much a cache-aware router can gain over round-robin, by simulation: the prefix-cache hit
rate of N replicas, each an LRU cache of 16-token blocks (a request hits the longest prefix of
its blocks held; its prompt and answer are then cached), under the workload of bench/router.py.

Workload (bench/router.py's defaults): --systems system prompts of --system-tokens tokens,
--conversations chats each opening with one of them, --turns turns of --user-tokens new tokens
and a --answer-tokens answer; --concurrency chats in flight, the next request coming from one of
them at random (a chat's turns in order; a finished chat makes room for the next). Policies:
round-robin, and cache-aware (the replica holding the longest prefix; ties taken in turn: no
load bound, so this is the most any prefix routing can get). Pool sizes in blocks per replica.

Prints, per replica count, the hit rates and their ratio at each pool size, and the largest
ratio. Pure Python, no server: seconds. Writes bench/results/router_sim.json.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import harness

BLOCK = 16


def block_hashes(tokens: list[int]) -> list[int]:
    """One hash per full block, each over the whole prefix up to its end (as a radix cache keys it)."""
    out, h = [], 0
    for i in range(len(tokens) // BLOCK):
        h = hash((h, tuple(tokens[i * BLOCK:(i + 1) * BLOCK])))
        out.append(h)
    return out


class LruReplica:
    def __init__(self, blocks: int):
        self.capacity = blocks
        self.cached: OrderedDict[int, None] = OrderedDict()

    def match(self, blocks: list[int]) -> int:
        n = 0
        for b in blocks:
            if b not in self.cached:
                break
            n += 1
        return n

    def serve(self, blocks: list[int]) -> int:
        """Blocks hit; then every block is cached (most recently used last), the oldest evicted."""
        hit = self.match(blocks)
        for b in blocks:
            self.cached[b] = None
            self.cached.move_to_end(b)
        while len(self.cached) > self.capacity:
            self.cached.popitem(last=False)
        return hit


def hit_rate(policy: str, replicas: int, pool: int, concurrency: int, args, seed: int) -> float:
    rng = random.Random(seed)
    systems = [[rng.randrange(1 << 40) for _ in range(args.system_tokens)] for _ in range(args.systems)]
    history = [list(systems[i % args.systems]) for i in range(args.conversations)]
    servers = [LruReplica(pool) for _ in range(replicas)]
    waiting, active = list(range(args.conversations)), {}
    turn = hits = looked = 0
    while waiting or active:
        while waiting and len(active) < concurrency:
            active[waiting.pop(0)] = args.turns
        chat = rng.choice(list(active))
        history[chat] += [rng.randrange(1 << 40) for _ in range(args.user_tokens)]
        blocks = block_hashes(history[chat])
        if policy == "round_robin":
            server = servers[turn % replicas]
        else:
            matches = [s.match(blocks) for s in servers]
            best = [s for s, m in zip(servers, matches) if m == max(matches)]
            server = best[turn % len(best)]
        turn += 1
        hits += server.serve(blocks) * BLOCK
        looked += len(history[chat])
        history[chat] += [rng.randrange(1 << 40) for _ in range(args.answer_tokens)]
        server.serve(block_hashes(history[chat]))
        active[chat] -= 1
        if not active[chat]:
            del active[chat]
    return hits / looked


def main() -> None:
    ap = harness.parser(__doc__, "router_sim")
    ap.add_argument("--systems", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=450)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-tokens", type=int, default=36)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--pools", type=int, nargs="+", default=[40, 60, 80, 100, 150, 200, 300, 400, 500, 800, 2000])
    ap.add_argument("--seeds", type=int, default=3, help="runs per point (hit rates averaged)")
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    report = {**head, "workload": {k: getattr(args, k) for k in ("systems", "system_tokens", "conversations", "turns",
                                                          "user_tokens", "answer_tokens", "seeds")}, "runs": []}
    for concurrency in args.concurrency:
        for replicas in args.replicas:
            rows = []
            for pool in args.pools:
                rates = {p: sum(hit_rate(p, replicas, pool, concurrency, args, seed)
                                for seed in range(args.seeds)) / args.seeds for p in ("cache_aware", "round_robin")}
                ratio = rates["cache_aware"] / rates["round_robin"] if rates["round_robin"] else None
                rows.append({"pool_blocks": pool, **rates, "ratio": ratio})
            best = max((r for r in rows if r["ratio"] is not None), key=lambda r: r["ratio"])
            report["runs"].append({"concurrency": concurrency, "replicas": replicas, "pools": rows, "best": best})
            print(f"{concurrency} chats in flight, {replicas} replicas: " + ", ".join(
                f"{r['pool_blocks']}: {r['cache_aware']:.2f}/{r['round_robin']:.2f}" for r in rows)
                + f"; largest ratio {best['ratio']:.2f}x at {best['pool_blocks']} blocks", flush=True)
    harness.write_report(args.out, report)


if __name__ == "__main__":
    main()
