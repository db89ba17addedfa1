"""The model worker (model_worker.py) and its tensor-parallel ranks (lockstep.py, follower.py):
the composition of the model, its KV cache, LoRA slots, sharding and speculation's draft and
verifier for the engine. Above model/, lora/, parallel/ and speculative/; below the engine."""
