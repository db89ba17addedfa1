"""Stored responses (`store: true` with --data-dir): each response's object and the conversation
it answered (its input items, earlier turns' included), in SQLite beside the Batch API's
database, owned by the tenant that created it. Bounded: at most `max_count` responses, none
older than `max_age` seconds (the oldest go first when one is added)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson

from pyserve.batches.store import open_database

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at INTEGER NOT NULL,
    response TEXT NOT NULL, input_items TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""


class ResponseStore:
    def __init__(self, data_dir: str | Path, max_count: int, max_age: float):
        root = Path(data_dir)
        root.mkdir(parents=True, exist_ok=True)
        self.max_count, self.max_age = max_count, max_age
        self.db = open_database(root / "responses.sqlite3", SCHEMA)

    def close(self) -> None:
        self.db.close()

    def add(self, owner: str, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("DELETE FROM responses WHERE created_at < ?", (int(time.time() - self.max_age),))
            self.db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?)",
                            (response["id"], owner, response["created_at"], orjson.dumps(response).decode(),
                             orjson.dumps(input_items).decode()))
            self.db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at DESC, "
                            "rowid DESC LIMIT -1 OFFSET ?)", (self.max_count,))

    def get(self, response_id: str, owner: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(response, input items) of a live response of `owner`'s; None for any other id."""
        row = self.db.execute("SELECT response, input_items FROM responses WHERE id = ? AND owner = ? AND "
                              "created_at >= ?", (response_id, owner, int(time.time() - self.max_age))).fetchone()
        return None if row is None else (orjson.loads(row[0]), orjson.loads(row[1]))

    def conversation(self, response_id: str, owner: str) -> list[dict[str, Any]] | None:
        """The items a response continuing this one starts from: its input, then its output."""
        found = self.get(response_id, owner)
        return None if found is None else found[1] + found[0]["output"]

    def delete(self, response_id: str, owner: str) -> bool:
        with self.db:
            cur = self.db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        return cur.rowcount > 0

    def __len__(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]
