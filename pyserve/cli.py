"""`pyserve serve [MODEL] ...` (the OpenAI-compatible server) and `pyserve batch ...` (OpenAI
Batch files, offline)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from pyserve.default_model import resolve_model, served_name

# uvicorn's pure-Python HTTP parser even where httptools is installed: h11 refuses a request
# whose head outgrows its 16 KiB buffer (httptools' parser takes any size of header).
HTTP_PARSER = "h11"


def _engine_args(p: argparse.ArgumentParser) -> None:
    from pyserve.config import EngineConfig
    from pyserve.options import add_flags

    p.add_argument("model", nargs="?", help="Hugging Face model directory (default: the embedded model)")
    p.add_argument("--served-model-name", default=None, help="the model name requests use (default: the directory's)")
    add_flags(p, EngineConfig)


def _engine_config(args: argparse.Namespace):
    """The EngineConfig the flags ask for (a bad value is a ValueError naming it; no torch yet)."""
    from pyserve.config import EngineConfig
    from pyserve.options import from_args

    lora_on_demand = bool(getattr(args, "lora_modules", None) or getattr(args, "lora_root", None))
    return EngineConfig(**from_args(
        EngineConfig, args, model=resolve_model(args.model), enable_lora=args.enable_lora or lora_on_demand,
        watchdog_timeout=args.watchdog_timeout or None,
    ))


def _engine(config):
    """Builds the engine; logs `engine_loaded` with the seconds spent importing torch, importing
    the rest of the engine, and building it (weights, KV cache, tokenizer, draft)."""
    import structlog

    began = time.perf_counter()
    import torch  # noqa: F401 - timed apart: the floor under any start

    torch_done = time.perf_counter()
    from pyserve.engine.async_engine import AsyncEngine

    imported = time.perf_counter()
    engine = AsyncEngine(config)
    structlog.get_logger("pyserve.cli").info(
        "engine_loaded", torch_import_seconds=round(torch_done - began, 3),
        import_seconds=round(imported - torch_done, 3), build_seconds=round(time.perf_counter() - imported, 3))
    return engine


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


def _served_models(args: argparse.Namespace) -> dict:
    """name -> ModelSpec for every model the flags ask for (see server.model_specs); a bad entry
    ends the command before anything loads."""
    from pyserve.config import EngineConfig
    from pyserve.options import from_args
    from pyserve.server.model_specs import (ModelEntry, ModelsConfigError, default_pair, engine_configs,
                                            load_models_file, model_flag)
    from pyserve.model.hub import is_hub_id
    from pyserve.serve_checks import check_model, check_speculation, hub_download, read_config
    from pyserve.server.models import ModelSpec

    try:
        entries = []
        if args.model is not None:
            entries.append(ModelEntry(args.served_model_name or served_name(args.model), args.model,
                                      lora_modules=dict(args.lora_modules)))
        entries += [ModelEntry(*model_flag(item)) for item in args.models]
        if args.models_config:
            entries += load_models_file(args.models_config)
        if args.served_model_name and args.model is None and entries:
            raise ModelsConfigError("--served-model-name names the positional MODEL (or the embedded model); "
                                    "models of --model and --models-config are named there")
        if not entries:
            entries = default_pair()
            entries[0].name = args.served_model_name or entries[0].name
        if args.model is None:  # the primary takes the command line's adapters
            entries[0].lora_modules = dict(args.lora_modules) | entries[0].lora_modules
        base = from_args(EngineConfig, args, watchdog_timeout=args.watchdog_timeout or None)
        if args.lora_root:
            entries[0].overrides.setdefault("enable_lora", True)
        configs = engine_configs(entries, base)
    except ModelsConfigError as e:
        sys.exit(f"pyserve serve: {e}")
    for config, _ in configs.values():
        check_model(config)
        check_speculation(config)
    policies = {e.name: e.policy for e in entries}
    return {name: ModelSpec(lambda c=config: _engine(c), loras, hub_download(config), policies[name],
                            check=(lambda c=config: read_config(c)) if is_hub_id(config.model) else None)
            for name, (config, loras) in configs.items()}


def serve(args: argparse.Namespace) -> None:
    """Reads each local model's config (one that cannot load ends the command at once), then binds
    the socket and builds the engines behind it (/health: 503 "loading", then 200); exits non-zero
    when one fails to load."""
    from pyserve.logs import configure_logging

    configure_logging()
    if os.environ.get("RANK", "0") != "0" and "WORLD_SIZE" in os.environ:  # a torchrun rank but the first
        from pyserve.worker.follower import follow_torchrun

        return follow_torchrun(_engine_config(args))
    if args.data_parallel_size < 1:
        sys.exit(f"pyserve serve: --data-parallel-size must be at least 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1:
        if args.data_dir or args.lora_root:  # the router forwards neither API to the replicas
            sys.exit("pyserve serve: --data-dir (the Batch API) and --lora-root (adapters loaded at run time) are "
                     "served by one server, not behind --data-parallel-size's router; give adapters with "
                     "--lora-modules, and run batches against a server of its own")
        return _serve_data_parallel(args)
    models = _served_models(args)
    import structlog  # the server's imports come after the local models' checks
    import uvicorn

    from pyserve.options import from_args
    from pyserve.server.app import build_app
    from pyserve.server.draining_server import DrainingServer
    from pyserve.server.settings import ServerSettings

    failures: list[BaseException] = []

    def load_failed(error: BaseException) -> None:
        failures.append(error)
        server.should_exit = True

    try:  # settings, routes and router files, before any model loads
        settings = ServerSettings(**from_args(ServerSettings, args, served_model_name=next(iter(models))))
        app = build_app(models, settings, on_load_failure=load_failed)
    except (ValueError, OSError) as e:
        sys.exit(f"pyserve serve: {e}")
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", http=HTTP_PARSER,
                                           access_log=False, timeout_graceful_shutdown=args.shutdown_timeout), app)
    # uvicorn drains on SIGTERM, then re-raises the signal under the handler it found: make that
    # one a no-op so a drained server exits 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    structlog.get_logger("pyserve.cli").info("server_starting", url=f"http://{args.host}:{args.port}")
    server.run()
    if failures:
        sys.exit(f"pyserve serve: the model failed to load: {failures[0]!r}")
    if not server.started:
        sys.exit(3)  # what uvicorn.run exits with when the server never started


def _serve_data_parallel(args: argparse.Namespace) -> None:
    """N replicas of this same command behind `pyserve router` on --host/--port, with the
    router's defaults; the replicas' API key is the router's."""
    from pyserve.replicas.local import LocalReplicas
    from pyserve.replicas.settings import RouterSettings

    replicas = LocalReplicas(args.argv, args.data_parallel_size)
    settings = RouterSettings(replica=replicas.urls, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                              public_metrics=args.public_metrics, allowed_origins=args.allowed_origins)
    replicas.start()
    try:
        _run_router(settings, args)
    finally:
        replicas.stop(args.shutdown_timeout)
    if replicas.failed is not None:
        sys.exit(f"pyserve serve: {replicas.failed}")


def router(args: argparse.Namespace) -> None:
    """`pyserve router --replica URL ...`."""
    from pyserve.logs import configure_logging
    from pyserve.options import from_args
    from pyserve.replicas.settings import RouterSettings

    configure_logging()
    try:
        settings = RouterSettings(**from_args(RouterSettings, args))
    except ValueError as e:
        sys.exit(f"pyserve router: {e}")
    _run_router(settings, args)


def _run_router(settings, args: argparse.Namespace) -> None:
    """Serves the router on args.host/port; exits non-zero, naming the replica, when one answers
    and is not a model server."""
    import uvicorn

    from pyserve.replicas.front import build_router_app

    refused: list[Exception] = []
    app = build_router_app(settings, on_refused=refused.append)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="critical", http=HTTP_PARSER,
                                           access_log=False, timeout_graceful_shutdown=args.shutdown_timeout))
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    except SystemExit:  # uvicorn's own exit when the lifespan fails
        if refused:
            sys.exit(f"pyserve router: {refused[0]}")
        raise


def batch(args: argparse.Namespace) -> None:
    from pyserve.logs import configure_logging
    from pyserve.server.offline_batch import read_input, run_batch
    from pyserve.server.settings import ServerSettings

    configure_logging()
    if not Path(args.input).is_file():  # before the model loads
        sys.exit(f"pyserve batch: no input file {args.input}")
    out_dir = Path(args.output).resolve().parent
    if not out_dir.is_dir() or not os.access(out_dir, os.W_OK):
        sys.exit(f"pyserve batch: --output: {out_dir} is not a directory this process can write to")
    settings = ServerSettings(served_model_name=args.served_model_name or served_name(args.model),
                              lora_modules=dict(args.lora_modules))
    try:
        lines = read_input(Path(args.input), settings)
    except ValueError as e:  # the file as a whole cannot be a batch input
        sys.exit(f"pyserve batch: --input: {str(e).removeprefix('input_file_id: ')}")
    engine = _engine(_engine_config(args))
    num_errors = asyncio.run(run_batch(engine, settings, lines, Path(args.output)))
    print(f"batch: wrote {args.output} ({num_errors} lines with errors)", file=sys.stderr, flush=True)
    health = engine.health()
    if health.status == "dead":  # the records say 503, but the batch did not run
        sys.exit(f"pyserve batch: the engine died: {health.error!r}")


DEFAULTS_SHOWN = argparse.ArgumentDefaultsHelpFormatter


def port_number(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0-65535, got {port}")
    return port


def seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"seconds must be 0 or more, got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    """No abbreviated flags: `serve --data-parallel 2` would reach the replicas, which would each
    start replicas of their own (LocalReplicas strips the flags by their full names)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)


class _Version(argparse.Action):
    """--version: prints the installed package's version (read only when asked: the metadata
    import costs every start tens of milliseconds) and exits."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0,
                         help="print pyserve's version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        import pyserve

        print(f"pyserve {pyserve.__version__}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    from pyserve.eagle_training.options import TrainOptions
    from pyserve.options import add_flags
    from pyserve.replicas.settings import RouterSettings
    from pyserve.server.settings import ServerSettings

    parser = _Parser(prog="pyserve", description="LLM serving engine")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server", formatter_class=DEFAULTS_SHOWN)
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=port_number, default=8000)
    s.add_argument("--shutdown-timeout", type=seconds, default=30.0, help="seconds to drain on SIGTERM")
    s.add_argument("--lora-modules", nargs="*", default=[], type=lora_module, metavar="NAME=PATH",
                   help="adapters of the (first) model served from the start (the request's model field names one)")
    s.add_argument("--model", dest="models", action="append", default=[], metavar="NAME=DIR",
                   help="one more model served under NAME (repeatable; see pyserve.server.model_specs)")
    s.add_argument("--models-config", default=None, metavar="FILE",
                   help="a YAML file of models to serve: name, model, kv_share, lora_modules, engine flags")
    s.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="serve N replicas of this command, each its own process, behind a router on --host/--port "
                   "that sends each request where its prefix is cached (see pyserve router)")
    add_flags(s, ServerSettings)
    s.set_defaults(func=serve)
    rt = sub.add_parser("router", help="an OpenAI-compatible front over replicas, routing by cached prefix",
                        formatter_class=DEFAULTS_SHOWN)
    rt.add_argument("--host", default="127.0.0.1")
    rt.add_argument("--port", type=port_number, default=8000)
    rt.add_argument("--shutdown-timeout", type=seconds, default=30.0, help="seconds to drain on SIGTERM")
    add_flags(rt, RouterSettings)
    rt.set_defaults(func=router)
    b = sub.add_parser("batch", help="run an OpenAI Batch input file offline", formatter_class=DEFAULTS_SHOWN)
    _engine_args(b)
    b.add_argument("--input", required=True)
    b.add_argument("--output", required=True)
    b.add_argument("--lora-modules", nargs="*", default=[], type=lora_module, metavar="NAME=PATH",
                   help="adapters the lines may name as their model (NAME=PATH, or an embedded adapter's name)")
    b.set_defaults(func=batch)
    e = sub.add_parser("eval", help="run an eval set through serving configurations: quality, cost, latency")
    e.add_argument("--data", required=True,
                   help="the eval set (JSON Lines; see pyserve.eval.items), or a built-in set: humaneval")
    e.add_argument("--configs", required=True, help="CONFIGS.yaml (see pyserve.eval.configs)")
    e.add_argument("--out", default="eval-out", help="folder for eval.json, eval.csv, eval.png and server logs")
    e.add_argument("--repeats", type=int, default=1, help="rounds, the configurations taking turns")
    e.add_argument("--limit", type=int, default=None, help="only the first N items (a quick run)")
    e.set_defaults(func=run_eval)
    r = sub.add_parser("route-train", help="train a router between two models from an eval that scored both")
    r.add_argument("--eval", required=True, help="eval.json of a pyserve eval run with both configurations")
    r.add_argument("--data", required=True, help="the eval set that run used (the items' prompts; or humaneval)")
    r.add_argument("--small", required=True, help="the small model's configuration name in eval.json")
    r.add_argument("--large", required=True, help="the large model's configuration name in eval.json")
    r.add_argument("--small-model", default=None, help="its served name (default: the configuration's name)")
    r.add_argument("--large-model", default=None, help="its served name (default: the configuration's name)")
    r.add_argument("--large-share", type=float, default=0.5, help="share of requests to send to the large model")
    r.add_argument("--embedding-model", default="wordllama", help="as pyserve serve's --embedding-model")
    r.add_argument("--out", required=True, help="the router's JSON file (pyserve serve --route NAME=FILE)")
    r.set_defaults(func=route_train)
    t = sub.add_parser("train-eagle", help="train an EAGLE-3 draft head for a model on its own answers",
                       formatter_class=DEFAULTS_SHOWN)
    t.add_argument("model", help="the target: a model directory, a GGUF file or a hub id")
    t.add_argument("--out", required=True, help="the head's folder (resumed from its checkpoint if there is one)")
    add_flags(t, TrainOptions)
    t.set_defaults(func=train_eagle)
    return parser


def train_eagle(args: argparse.Namespace) -> None:
    from pyserve.eagle_training.options import TrainOptions
    from pyserve.eagle_training.train import train_eagle
    from pyserve.model.hub import fetch_model
    from pyserve.options import from_args

    train_eagle(fetch_model(args.model, None, None), args.out, TrainOptions(**from_args(TrainOptions, args)))


def route_train(args: argparse.Namespace) -> None:
    import json

    from pyserve.embeddings.load import load_encoder
    from pyserve.eval.items import EvalSetError, load_eval_data
    from pyserve.model_choice.classifier import routed_text
    from pyserve.model_choice.train import eval_scores, train_classifier

    try:
        items = load_eval_data(args.data)
        small, large = eval_scores(args.eval, args.small), eval_scores(args.eval, args.large)
        encoder = load_encoder(args.embedding_model)
        if encoder is None:
            raise ValueError("--embedding-model: a router needs an embedding model")
        prompts = {i.id: i.prompt if i.prompt is not None else
                   routed_text([(str(m.get("role", "")), str(m.get("content", ""))) for m in i.messages])
                   for i in items}
        classifier, figures = train_classifier(encoder, prompts, small, large, args.small_model or args.small,
                                               args.large_model or args.large, args.large_share)
    except (EvalSetError, ValueError, OSError, KeyError) as e:
        sys.exit(f"pyserve route-train: {e}")
    classifier.trained_on |= {"eval": str(args.eval), "small": args.small, "large": args.large}
    classifier.save(args.out)
    print(json.dumps({"router": args.out, "cross_validated": figures}, indent=1))


def run_eval(args: argparse.Namespace) -> None:
    from pyserve.eval.configs import ConfigsError, load_plan
    from pyserve.eval.harness import machine, run_plan, table, write_report
    from pyserve.eval.items import EvalSetError, load_eval_data

    try:  # both checked before anything runs
        items = load_eval_data(args.data)
        plan = load_plan(args.configs)
    except (EvalSetError, ConfigsError, OSError) as e:
        sys.exit(f"pyserve eval: {e}")
    if args.repeats < 1 or (args.limit is not None and args.limit < 1):
        sys.exit("pyserve eval: --repeats and --limit must be at least 1")
    items = items[: args.limit]
    total = len(items) * len(plan.configs) * args.repeats
    done = 0

    def progress() -> None:
        nonlocal done
        done += 1
        width = 30
        filled = width * done // total
        print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} items", end="", file=sys.stderr,
              flush=True)

    out = Path(args.out)
    reports = run_plan(plan, items, out, args.repeats, progress)
    print(file=sys.stderr)
    meta = {"machine": machine(), "data": str(args.data), "configs": str(args.configs), "items": len(items),
            "repeats": args.repeats, "price_per_hour": plan.price_per_hour, "concurrency": plan.concurrency}
    paths = write_report(reports, out, meta)
    print(table(reports))
    print("\n" + ", ".join(str(p) for p in paths.values()))
    if all(r.status == "failed" for r in reports):
        sys.exit("pyserve eval: every configuration failed")


def main(argv: list[str] | None = None) -> None:
    from pyserve.child_process import read_secrets

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    read_secrets(args, os.environ)  # --api-key / --replica-api-key left off: PYSERVE_API_KEY, ...
    args.func(args)


if __name__ == "__main__":
    main()
