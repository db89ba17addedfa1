"""What `pyserve serve` settles about each model before the server's imports (~0.5 s) and its
socket, without torch: the model's config read (a hub id's repository looked up) and its
speculative_config parsed, so that a model that cannot load ends the command at once; and the hub
download a model's engine waits for."""

from __future__ import annotations

import sys


def check_model(config) -> None:
    """Before the server's imports (~0.5 s) and its socket, a local model's config read, a hub id's
    repository looked up (its config is read once its files are downloaded): a model that cannot
    load ends the command at once."""
    from pyserve.model.hub import check_hub_model, is_hub_id

    try:
        if is_hub_id(config.model):
            check_hub_model(config.model, config.revision, config.gguf_file)
        else:
            read_config(config)
    except Exception as e:  # noqa: BLE001 - any failure to read the model ends the command
        _exit_load_failed(e)


def check_speculation(config) -> None:
    """The config's speculative_config checked as its engine will parse it (a hub id looked up,
    not fetched) before the server's imports and its socket: a bad one ends the command at once."""
    from pyserve.speculative.config import SpeculativeConfig, default_speculators

    try:
        SpeculativeConfig.parse(config.speculative_config, default_speculators(config.model), download=False)
    except ValueError as e:
        sys.exit(f"pyserve serve: {e}")


def _exit_load_failed(error: BaseException) -> None:
    """Ends `pyserve serve` before its socket is bound: `server_load_failed` logged, exit 1."""
    import structlog

    from pyserve.logs import process_seconds

    structlog.get_logger("pyserve.cli").error("server_load_failed", error=repr(error),
                                              seconds=round(process_seconds(), 3))
    sys.exit(f"pyserve serve: the model failed to load: {error!r}")


def read_config(config):
    """The config's model read as its engine will read it, without torch (whose import takes
    seconds): a missing path, an unreadable file, an unsupported architecture or a context the
    model cannot serve ends the load with its message at once."""
    from pyserve.model.checkpoint import load_config
    from pyserve.model.hub import fetch_model

    cfg = load_config(fetch_model(config.model, config.revision, config.gguf_file))
    cfg.check_context(cfg.served_length(config.max_model_len))
    return cfg


def hub_download(config):
    """The hub download of the config's model before its engine is built (None: a local path)."""
    from pyserve.model.hub import fetch_model, is_hub_id

    if not is_hub_id(config.model):
        return None
    return lambda: fetch_model(config.model, config.revision, config.gguf_file)
