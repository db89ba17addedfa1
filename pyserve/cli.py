"""`pyserve serve [MODEL] ...` (the OpenAI-compatible server) and `pyserve batch ...` (OpenAI
Batch files, offline)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from pyserve.default_model import resolve_model, served_name


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="Hugging Face model directory (default: the embedded model)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (per-request, batched)")
    p.add_argument("--max-loras", type=int, default=4, help="adapters resident on the device per step")
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or {"method": "draft_model"}')


def _engine(args: argparse.Namespace):
    from pyserve.engine.async_engine import AsyncEngine
    from pyserve.engine.config import EngineConfig

    config = EngineConfig(
        model=resolve_model(args.model), device=args.device, dtype=args.dtype, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
        speculative_config=args.speculative_config,
        enable_lora=args.enable_lora or bool(getattr(args, "lora_modules", None) or getattr(args, "lora_root", None)),
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        watchdog_timeout=getattr(args, "watchdog_timeout", None) or None,
    )
    return AsyncEngine(config)


def lora_module(item: str) -> tuple[str, str]:
    """One --lora-modules entry: NAME=PATH, or the short name of an embedded adapter (docstrings,
    tests)."""
    from pyserve.default_model import ADAPTER_DIRS

    name, sep, path = item.partition("=")
    if sep:
        return name, path
    if name not in ADAPTER_DIRS:
        raise argparse.ArgumentTypeError(f"{item!r}: use NAME=PATH (short names: {', '.join(ADAPTER_DIRS)})")
    return name, str(ADAPTER_DIRS[name])


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from pyserve.logs import configure_logging
    from pyserve.server.app import build_app
    from pyserve.server.state import ServerSettings

    configure_logging()
    engine = _engine(args)
    settings = ServerSettings(
        served_model_name=args.served_model_name or served_name(args.model),
        api_key=args.api_key, max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
        public_metrics=args.public_metrics, lora_modules=dict(args.lora_modules), lora_root=args.lora_root,
        stream_timeout=args.stream_timeout, max_stream_buffer=args.max_stream_buffer,
        trust_request_chat_template=args.trust_request_chat_template, chat_template_timeout=args.chat_template_timeout,
    )
    app = build_app(engine, settings)
    # uvicorn drains on SIGTERM, then re-raises the signal under the handler it found: make that
    # one a no-op so a drained server exits 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=args.shutdown_timeout)


def batch(args: argparse.Namespace) -> None:
    from pyserve.logs import configure_logging
    from pyserve.server.batch import run_batch

    configure_logging()
    if not Path(args.input).is_file():  # before the model loads
        sys.exit(f"pyserve batch: no input file {args.input}")
    engine = _engine(args)
    name = args.served_model_name or served_name(args.model)
    num_errors = asyncio.run(run_batch(engine, name, Path(args.input), Path(args.output)))
    print(f"batch: wrote {args.output} ({num_errors} lines with errors)", file=sys.stderr, flush=True)
    health = engine.health()
    if health.status == "dead":  # the records say 503, but the batch did not run
        sys.exit(f"pyserve batch: the engine died: {health.error!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pyserve", description="LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--max-waiting", type=int, default=None, help="429 once this many sequences wait")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20)
    s.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to drain on SIGTERM")
    s.add_argument("--lora-modules", nargs="*", default=[], type=lora_module, metavar="NAME=PATH",
                   help="adapters served from the start (the request's model field names one)")
    s.add_argument("--lora-root", default=None,
                   help="enable /v1/load_lora_adapter and /v1/unload_lora_adapter for adapters under DIR")
    s.add_argument("--stream-timeout", type=float, default=60.0,
                   help="seconds a streaming client may take to accept one chunk before it is dropped")
    s.add_argument("--max-stream-buffer", type=int, default=1024,
                   help="chunks a streaming client may leave unread before its request is aborted")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template field in chat requests (rendered in the sandbox, under the timeout)")
    s.add_argument("--chat-template-timeout", type=float, default=2.0, help="seconds a chat template may take to render")
    s.add_argument("--watchdog-timeout", type=float, default=60.0,
                   help="seconds with requests held but no step completed before /health fails (0 = off)")
    s.set_defaults(func=serve)
    b = sub.add_parser("batch", help="run an OpenAI Batch input file offline")
    _engine_args(b)
    b.add_argument("--input", required=True)
    b.add_argument("--output", required=True)
    b.add_argument("--served-model-name", default=None)
    b.set_defaults(func=batch)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
