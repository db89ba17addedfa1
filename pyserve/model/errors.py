"""Errors of loading a checkpoint's weights."""


class WeightsError(ValueError):
    """The model directory has no usable weights: missing, unexpected or misshapen tensors."""
