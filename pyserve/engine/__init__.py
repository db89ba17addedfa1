"""The engine: the EngineCore step loop, the offline LLM API, sampling params and outputs."""
