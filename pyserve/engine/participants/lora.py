"""With LoRA enabled: the adapter of every scheduled request (0: the base model), for the
worker, which applies the adapters a step needs before its forward."""

from __future__ import annotations

import numpy as np

from pyserve.engine.participants.base import Step, StepParticipant


class LoraAdapters(StepParticipant):
    def before_forward(self, step: Step) -> None:
        requests, req_ids = step.requests, step.req_ids
        step.adapter_ids = np.fromiter((requests[rid].adapter_id for rid in req_ids), np.int64, len(req_ids))
