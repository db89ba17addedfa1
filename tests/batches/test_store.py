from pyserve.batches.store import BatchStore


def test_a_line_is_answered_once_and_survives_a_reopen(tmp_path):
    store = BatchStore(tmp_path)
    f = store.add_file("alice", "batch", "in.jsonl", b"line\n")
    store.add_batch("alice", {"id": "b1", "status": "in_progress"})
    assert store.add_result("b1", 2, True, {"custom_id": "c"})
    assert not store.add_result("b1", 2, False, {"custom_id": "again"})  # the first answer stands
    assert store.add_result("b1", 0, False, {"custom_id": "a"})
    store.close()
    store = BatchStore(tmp_path)  # as after a restart
    assert store.counts("b1") == (1, 1)
    assert store.answered("b1") == {0, 2}
    assert store.results("b1", True) == ['{"custom_id": "c"}']
    assert store.file(f.id, "alice").bytes == 5 and store.content(f.id) == b"line\n"
    assert store.file(f.id, "bob") is None and store.batch("b1", "bob") is None
    assert [b["id"] for _, b in store.active_batches()] == ["b1"]
    store.delete_file(f.id)
    assert store.files("alice") == []


def test_a_completed_lines_tokens_are_added_once_and_survive_a_reopen(tmp_path):
    store = BatchStore(tmp_path)
    assert store.usage("b1") == (0, 0, 0, 0)
    assert store.add_result("b1", 0, True, {}, (10, 4, 3, 1))
    assert not store.add_result("b1", 0, True, {}, (10, 4, 3, 1))  # the line's first answer stands
    assert store.add_result("b1", 1, True, {}, (5, 0, 2, 0))
    assert store.add_result("b1", 2, False, {}, (7, 7, 7, 7))  # failed lines count no tokens
    store.close()
    assert BatchStore(tmp_path).usage("b1") == (15, 4, 5, 1)
