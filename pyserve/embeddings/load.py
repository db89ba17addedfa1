"""The server's embedding model from its `--embedding-model` setting."""

from __future__ import annotations

from pathlib import Path

from pyserve.embeddings.encoder import Encoder

PACKAGED = "wordllama"


def load_encoder(setting: str) -> Encoder | None:
    """'none': no embedding model; 'wordllama': the packaged one; else a Hugging Face encoder
    directory (ValueError naming the setting when there is none)."""
    if setting == "none":
        return None
    if setting == PACKAGED:
        from pyserve.embeddings.packaged import PackagedEncoder

        return PackagedEncoder()
    if not (Path(setting) / "config.json").is_file():
        raise ValueError(f"embedding_model: {setting!r} is neither 'wordllama', 'none' nor a model directory "
                         f"with a config.json")
    from pyserve.embeddings.hf_encoder import HFEncoder

    return HFEncoder(setting)
