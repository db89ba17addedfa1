"""The Batch API's durable state: files on disk under the data directory, their records and the
jobs' in SQLite (the standard library's sqlite3), one row per answered line, and per job the
tokens of its completed lines.

A line's result is one row, written once (`add_result` ignores a second write; a completed
line's tokens are added to its job's in the same transaction): a server killed at any point
restarts with every line either answered (its row) or not (run again), never both or twice. The output and error files are written from those rows when a job ends.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (batch_id, line));
CREATE TABLE IF NOT EXISTS usage (
    batch_id TEXT PRIMARY KEY, input_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL, reasoning_tokens INTEGER NOT NULL);
"""
# Statuses from which a job still needs the runner, in the order OpenAI documents them.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


@dataclass(slots=True)
class FileRecord:
    id: str
    owner: str
    purpose: str
    filename: str
    bytes: int
    created_at: int

    def public(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


def open_database(path: Path, schema: str) -> sqlite3.Connection:
    """The SQLite database at `path` with `schema` applied, in autocommit mode (a transaction is
    begun where one is needed), usable from any thread."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    # WAL with NORMAL: a committed row survives the process being killed (not a power cut, which
    # may lose the last commits: a batch's lines then run again, a response is not stored).
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(schema)
    return db


class BatchStore:
    def __init__(self, data_dir: str | Path):
        self.root = Path(data_dir)
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.db = open_database(self.root / "batches.sqlite3", SCHEMA)

    def close(self) -> None:
        self.db.close()

    # Files.

    def add_file(self, owner: str, purpose: str, filename: str, content: bytes) -> FileRecord:
        return self.add_written_file(owner, purpose, filename, self.write_content(content), len(content))

    def write_content(self, content: bytes) -> str:
        """A new file id, its content on disk, whole or absent; no row yet (add_written_file). Touches
        no row of the database: a large upload is written on a thread."""
        file_id = f"file-{uuid.uuid4().hex}"
        tmp = self.files_dir / (file_id + ".tmp")
        tmp.write_bytes(content)
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        tmp.rename(self.files_dir / file_id)
        return file_id

    def add_written_file(self, owner: str, purpose: str, filename: str, file_id: str, size: int) -> FileRecord:
        record = FileRecord(file_id, owner, purpose, filename, size, int(time.time()))
        self.db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                        (record.id, owner, purpose, filename, record.bytes, record.created_at))
        return record

    def file(self, file_id: str, owner: str) -> FileRecord | None:
        row = self.db.execute("SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
        return FileRecord(*row) if row else None

    def files(self, owner: str, purpose: str | None = None) -> list[FileRecord]:
        rows = self.db.execute("SELECT * FROM files WHERE owner = ? AND (? IS NULL OR purpose = ?) "
                               "ORDER BY created_at DESC, rowid DESC", (owner, purpose, purpose)).fetchall()
        return [FileRecord(*r) for r in rows]

    def content(self, file_id: str) -> bytes:
        return (self.files_dir / file_id).read_bytes()

    def delete_file(self, file_id: str) -> None:
        self.db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        (self.files_dir / file_id).unlink(missing_ok=True)

    # Jobs: the OpenAI batch object is kept whole, as JSON.

    def add_batch(self, owner: str, batch: dict) -> None:
        self.db.execute("INSERT INTO batches VALUES (?, ?, ?)", (batch["id"], owner, json.dumps(batch)))

    def batch(self, batch_id: str, owner: str | None = None) -> dict | None:
        row = self.db.execute("SELECT body FROM batches WHERE id = ? AND (? IS NULL OR owner = ?)",
                              (batch_id, owner, owner)).fetchone()
        return json.loads(row[0]) if row else None

    def owner(self, batch_id: str) -> str:
        return self.db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()[0]

    def batches(self, owner: str) -> list[dict]:
        rows = self.db.execute("SELECT body FROM batches WHERE owner = ? ORDER BY rowid DESC", (owner,)).fetchall()
        return [json.loads(r[0]) for r in rows]

    def active_batches(self) -> list[tuple[str, dict]]:
        """(owner, batch) of every job the runner must carry on, oldest first."""
        rows = self.db.execute("SELECT owner, body FROM batches ORDER BY rowid").fetchall()
        return [(o, b) for o, b in ((o, json.loads(body)) for o, body in rows) if b["status"] in ACTIVE]

    def save_batch(self, batch: dict) -> None:
        self.db.execute("UPDATE batches SET body = ? WHERE id = ?", (json.dumps(batch), batch["id"]))

    # Lines.

    def add_result(self, batch_id: str, line: int, ok: bool, record: dict,
                   tokens: tuple[int, int, int, int] = (0, 0, 0, 0)) -> bool:
        """Stores a line's result, and when `ok` adds its `tokens` (input, cached, output, reasoning)
        to its job's usage; False (and nothing written) if the line has one already."""
        self.db.execute("BEGIN")
        with self.db:  # commits, or rolls back on an exception
            cur = self.db.execute("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)",
                                  (batch_id, line, int(ok), json.dumps(record)))
            if cur.rowcount == 1 and ok:
                self.db.execute("INSERT INTO usage VALUES (?, ?, ?, ?, ?) ON CONFLICT (batch_id) DO UPDATE SET "
                                "input_tokens = input_tokens + excluded.input_tokens, "
                                "cached_tokens = cached_tokens + excluded.cached_tokens, "
                                "output_tokens = output_tokens + excluded.output_tokens, "
                                "reasoning_tokens = reasoning_tokens + excluded.reasoning_tokens", (batch_id, *tokens))
        return cur.rowcount == 1

    def usage(self, batch_id: str) -> tuple[int, int, int, int]:
        """(input, cached, output, reasoning) tokens of the job's completed lines."""
        row = self.db.execute("SELECT input_tokens, cached_tokens, output_tokens, reasoning_tokens FROM usage "
                              "WHERE batch_id = ?", (batch_id,)).fetchone()
        return tuple(row) if row else (0, 0, 0, 0)

    def answered(self, batch_id: str) -> set[int]:
        return {r[0] for r in self.db.execute("SELECT line FROM results WHERE batch_id = ?", (batch_id,))}

    def counts(self, batch_id: str) -> tuple[int, int]:
        """(completed, failed) lines."""
        row = self.db.execute("SELECT COALESCE(SUM(ok), 0), COUNT(*) - COALESCE(SUM(ok), 0) FROM results "
                              "WHERE batch_id = ?", (batch_id,)).fetchone()
        return int(row[0]), int(row[1])

    def results(self, batch_id: str, ok: bool) -> list[str]:
        """The JSON records of the answered (ok) or failed lines, in input order."""
        rows = self.db.execute("SELECT record FROM results WHERE batch_id = ? AND ok = ? ORDER BY line",
                               (batch_id, int(ok))).fetchall()
        return [r[0] for r in rows]
