"""The training pipeline of the embedded default model family (`python -m
pyserve.default_model.training`); needs the `train` extra (transformers, peft)."""
