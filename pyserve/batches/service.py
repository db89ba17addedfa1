"""What the Batch API's routes share: the store, the runner and the upload bound."""

from __future__ import annotations

from dataclasses import dataclass

from pyserve.batches.runner import BatchRunner
from pyserve.batches.store import BatchStore


@dataclass(slots=True)
class BatchService:
    store: BatchStore
    runner: BatchRunner
    max_file_bytes: int
