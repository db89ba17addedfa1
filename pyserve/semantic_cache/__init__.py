"""The semantic cache for chat: answers a conversation like one already answered, within its
exact scope (tenant, model, adapter, system prompt, sampling, tools, response format), from a
vector index (usearch) over the embedded conversations, a hit also needing the same numbers,
names and negations and more than one word changed (guard.py), under a similarity threshold
calibrated to an error bound (threshold.py). store.py holds the entries (TTL, LRU, bounded)."""
