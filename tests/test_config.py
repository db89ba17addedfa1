"""Every default spelled once: EngineConfig and ServerSettings are the source of LLM(...)'s
keywords, the CLI's flags and the Rust binding's defaults."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from pyserve import LLM, _core
from pyserve.cli import build_parser
from pyserve.model.config import DEFAULT_MAX_MODEL_LEN
from pyserve.config import EngineConfig
from pyserve.server.settings import ServerSettings
from pyserve.worker.model_worker import ModelWorker

PYSERVE = Path(__file__).resolve().parents[1] / "pyserve"


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def test_the_binding_defaults_agree_with_the_engine_config():
    binding = {name: p.default for name, p in inspect.signature(_core.Scheduler).parameters.items()
               if p.default is not inspect.Parameter.empty}
    engine = _defaults(EngineConfig)
    shared = {"block_size", "max_num_batched_tokens", "max_num_seqs", "max_loras", "enable_prefix_caching"}
    assert shared <= binding.keys()
    assert {k: binding[k] for k in shared} == {k: engine[k] for k in shared}
    assert binding["max_model_len"] == DEFAULT_MAX_MODEL_LEN  # the engine's cap when the model allows more


def test_serve_flags_default_to_the_config_defaults():
    args = build_parser().parse_args(["serve"])
    engine, settings = _defaults(EngineConfig), _defaults(ServerSettings)
    for name in ("device", "dtype", "block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens",
                 "max_model_len", "enable_prefix_caching", "enable_lora", "max_loras", "max_lora_rank", "seed",
                 "speculative_config", "max_inter_token_latency", "watchdog_timeout"):
        assert getattr(args, name) == engine[name], name
    for name in ("api_key", "max_waiting", "max_body_bytes", "public_metrics", "lora_root", "stream_timeout",
                 "max_stream_buffer", "trust_request_chat_template", "chat_template_timeout"):
        assert getattr(args, name) == settings[name], name


def test_flags_set_the_fields_they_name():
    args = build_parser().parse_args(["serve", "--no-prefix-caching", "--max-loras", "2", "--api-key", "k",
                                      "--stream-timeout", "5", "--trust-request-chat-template"])
    assert (args.enable_prefix_caching, args.max_loras, args.api_key) == (False, 2, "k")
    assert (args.stream_timeout, args.trust_request_chat_template) == (5.0, True)


def test_the_latency_target_flag_reads_seconds_and_zero_turns_it_off():
    args = build_parser().parse_args(["serve", "--max-inter-token-latency", "0.25"])
    assert args.max_inter_token_latency == 0.25
    assert EngineConfig(model="m", max_inter_token_latency=0.0).max_inter_token_latency == 0.0  # off


@pytest.mark.parametrize("value", [-0.1, float("inf"), float("nan")])
def test_a_bad_latency_target_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="max_inter_token_latency"):
        EngineConfig(model="m", max_inter_token_latency=value)


def test_llm_refuses_a_keyword_that_is_no_config_field():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "CPU", ""])
def test_a_device_that_is_no_device_is_refused_before_anything_loads(device):
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        EngineConfig(model="m", device=device)
    for good in ("auto", "cpu", "cuda", "cuda:1"):
        assert EngineConfig(model="m", device=good).device == good


# The packages EngineConfig's values are built into: the engine, the worker and what they construct.
BUILT_FROM_CONFIG = ("engine", "worker", "model", "lora", "parallel", "speculative")


def _defaults_named(path: Path, names: set[str]) -> list[str]:
    """`file:line name` for each function parameter, and each field of a class body, that is
    named like one of `names` and has a default."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            positional = a.posonlyargs + a.args
            with_default = positional[len(positional) - len(a.defaults):]
            with_default += [arg for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            found += [f"{path.relative_to(PYSERVE.parent)}:{node.lineno} {arg.arg}" for arg in with_default
                      if arg.arg in names]
        elif isinstance(node, ast.ClassDef):
            found += [f"{path.relative_to(PYSERVE.parent)}:{s.lineno} {s.target.id}" for s in node.body
                      if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is not None
                      and s.target.id in names]
    return found


def test_no_engine_default_is_spelled_twice():
    """EngineConfig's values reach what is built from it as arguments: in the packages built from
    it, no parameter or field named like a field of EngineConfig has a default of its own (a caller
    that forgot to pass the config's value would get it silently), and ModelWorker.from_config
    takes every argument."""
    names = set(_defaults(EngineConfig))
    restated = [hit for package in BUILT_FROM_CONFIG for path in sorted((PYSERVE / package).rglob("*.py"))
                for hit in _defaults_named(path, names)]
    assert not restated, f"EngineConfig's defaults spelled again: {restated}"
    for build in (ModelWorker.from_config, ModelWorker):
        defaulted = [p.name for p in inspect.signature(build).parameters.values() if p.default is not p.empty]
        assert not defaulted, f"{build.__qualname__} gives defaults to {defaulted}"
