"""Stored responses (server/response_store.py): kept per owner, pruned by age and count, kept
across a reopen of the database."""

from __future__ import annotations

import time

from pyserve.server.response_store import ResponseStore


def _response(rid: str, created_at: int) -> dict:
    return {"id": rid, "created_at": created_at, "output": [{"type": "message", "id": f"msg_{rid}"}]}


def test_responses_are_per_owner_bounded_by_age_and_count_and_survive_a_reopen(tmp_path):
    now = int(time.time())
    store = ResponseStore(tmp_path, max_count=3, max_age=3600)
    store.add("alice", _response("old", now - 7200), [])  # older than max_age: never served
    assert store.get("old", "alice") is None
    store.add("alice", _response("a", now), [{"type": "message", "id": "in_a"}])
    assert store.get("old", "alice") is None and len(store) == 1  # pruned by the next add
    assert store.get("a", "bob") is None
    assert store.conversation("a", "alice") == [{"type": "message", "id": "in_a"},
                                                {"type": "message", "id": "msg_a"}]
    for rid in ("b", "c", "d"):
        store.add("bob", _response(rid, now), [])
    assert len(store) == 3 and store.get("a", "alice") is None  # the oldest went first
    assert not store.delete("b", "alice") and store.delete("b", "bob") and store.get("b", "bob") is None
    store.close()
    again = ResponseStore(tmp_path, max_count=3, max_age=3600)
    assert [again.get(rid, "bob")[0]["id"] for rid in ("c", "d")] == ["c", "d"]
    again.close()
