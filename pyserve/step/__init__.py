"""The contract between the engine and the model worker, below both: what a request asks for
(SamplingParams), the request as the step sees it (EngineRequest), a step's rows and result, and
the messages of the engine's actors (request.py). No torch, no engine."""
