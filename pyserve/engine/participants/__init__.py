"""The step's optional parts (penalties' output tokens, prompt logprobs, LoRA adapter ids,
speculation, grammar), each a StepParticipant the EngineCore calls at fixed points of its step."""

from pyserve.engine.participants.base import Step, StepParticipant

__all__ = ["Step", "StepParticipant"]
