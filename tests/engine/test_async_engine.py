"""The engine's face (what the server may use of it), the layering rules, where the forwards run,
and an engine's end without noise."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import pyserve
from pyserve import SamplingParams
from pyserve.engine.async_engine import CPU_ENGINE_THREAD, AsyncEngine
from pyserve.config import EngineConfig
from pyserve.worker.model_worker import ModelWorker

PACKAGE = Path(pyserve.__file__).parent


def test_the_server_uses_only_the_engines_public_face():
    inner = re.compile(r"(?<!pyserve\.)engine\.(system|worker|watchdog|scheduler|engine_core|output_processor|model_config|config)\b")
    files = [*sorted((PACKAGE / "server").glob("*.py")), PACKAGE / "cli.py"]
    offending = [f"{f.name}:{n}" for f in files for n, line in enumerate(f.read_text().splitlines(), 1)
                 if inner.search(line)]
    assert offending == []


def test_only_the_engine_core_and_its_step_parts_call_the_scheduler():
    """The EngineCore owns the Scheduler: what other threads need of it (waiting and running
    counts, its stats, whether it is idle) they read from `EngineCore.published`; the speculator
    returns its drafts to the core. Only the n-gram proposer, the scheduler's own lookup over the
    tokens it holds, calls it, inside the core's step."""
    calls = re.compile(r"\bscheduler\.(\w+)")
    owners = {"engine/core.py", "speculative/proposer.py"}
    offending = [f"{p.relative_to(PACKAGE)}:{n}: {m.group(0)}" for p in sorted(PACKAGE.rglob("*.py"))
                 if p.relative_to(PACKAGE).as_posix() not in owners
                 for n, line in enumerate(p.read_text().splitlines(), 1) for m in calls.finditer(line)]
    assert offending == []


def test_no_engine_module_imports_torch():
    importing = re.compile(r"^\s*(import torch|from torch)\b", re.M)
    modules = sorted((PACKAGE / "engine").rglob("*.py"))
    assert len(modules) > 15 and [f.name for f in modules if importing.search(f.read_text())] == []


def test_the_rust_core_has_no_pyo3():
    core = Path(__file__).resolve().parents[2] / "rust" / "core"
    sources = [core / "Cargo.toml", *sorted(core.rglob("*.rs"))]
    assert len(sources) > 5 and [p.name for p in sources if "pyo3" in p.read_text()] == []


@pytest.mark.parametrize("ending", ["", "del llm\nimport gc\ngc.collect()\n"])
def test_an_llm_left_open_ends_quietly(llama_dir, tmp_path, ending):
    script = (f"from pyserve import LLM, SamplingParams\nllm = LLM({str(llama_dir)!r}, device='cpu', num_kv_blocks=32)\n"
              "print(len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids))\n"
              + ending)
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout.strip()) == (0, "3"), run.stderr
    assert "actor_crashed" not in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("own_thread", [True, False])
async def test_the_model_is_built_and_run_on_the_engines_thread_or_the_callers_loop(llama_dir, own_thread,
                                                                                    monkeypatch):
    """One thread computes with the model's tensors, its loading included (one OpenMP team:
    see AsyncEngine.__init__)."""
    built_on = []
    from_config = ModelWorker.from_config
    monkeypatch.setattr(ModelWorker, "from_config",
                        lambda *a, **k: (built_on.append(threading.current_thread().name), from_config(*a, **k))[1])
    engine = AsyncEngine(EngineConfig(model=str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64,
                                      watchdog_timeout=None), own_thread=own_thread)
    ran_on = []
    execute = engine.worker.execute
    engine.worker.execute = lambda *a: (ran_on.append(threading.current_thread().name), execute(*a))[1]
    await engine.start()
    try:
        stream = await engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))
        await asyncio.wait_for(stream.done.wait(), 60)
    finally:
        await engine.stop()
    assert len(stream.output.outputs[0].token_ids) == 4
    here = threading.current_thread().name
    assert ran_on and set(ran_on) == ({"pyserve-engine"} if own_thread else {here})
    assert built_on == ["pyserve-engine" if own_thread else here]


async def test_the_cpu_engines_of_a_process_share_one_thread_and_serve_side_by_side(llama_dir):
    idents = []
    from_config = ModelWorker.from_config

    def record(*a, **k):
        idents.append(threading.get_ident())
        return from_config(*a, **k)

    config = EngineConfig(model=str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64, watchdog_timeout=None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModelWorker, "from_config", record)
        engines = [AsyncEngine(config), AsyncEngine(config)]
    for engine in engines:
        await engine.start()
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0)
        streams = [await engine.add_request(f"r{i}", [5, 6, 7], params) for i, engine in enumerate(engines)]
        await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in streams)), 60)
        assert CPU_ENGINE_THREAD.holders == 2
    finally:
        for engine in engines:
            await engine.stop()
    assert len(set(idents)) == 1 and idents[0] != threading.get_ident()
    tokens = [s.output.outputs[0].token_ids for s in streams]
    assert len(tokens[0]) == 6 and tokens[0] == tokens[1]
    assert CPU_ENGINE_THREAD.holders == 0  # the thread closed with its last engine


def test_an_engine_failing_after_its_model_is_built_lets_go_of_the_shared_thread(llama_dir, monkeypatch):
    """An error while the engine is assembled around its built worker releases its hold on the
    CPU engines' thread: the thread closes with no engine left, and the next engine serves."""
    import pyserve.engine.async_engine as async_engine

    config = EngineConfig(model=str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64, watchdog_timeout=None)
    closed = []
    close = ModelWorker.close
    monkeypatch.setattr(ModelWorker, "close", lambda self: (closed.append(self), close(self)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(async_engine, "EngineCore", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("assembly")))
        with pytest.raises(RuntimeError, match="assembly"):
            AsyncEngine(config)
    assert CPU_ENGINE_THREAD.holders == 0 and len(closed) == 1

    async def serve() -> list[int]:
        engine = AsyncEngine(config)
        await engine.start()
        try:
            stream = await engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))
            await asyncio.wait_for(stream.done.wait(), 60)
            return stream.output.outputs[0].token_ids
        finally:
            await engine.stop()

    assert len(asyncio.run(serve())) == 4
    assert CPU_ENGINE_THREAD.holders == 0


async def test_a_priority_past_the_schedulers_range_is_refused_and_the_engine_serves_on(llama_dir):
    engine = AsyncEngine(EngineConfig(model=str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64,
                                      watchdog_timeout=None), own_thread=False)
    await engine.start()
    try:
        with pytest.raises(ValueError, match="priority"):
            await engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2), priority=2**31)
        stream = await engine.add_request("s", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0))
        await asyncio.wait_for(stream.done.wait(), 60)
        assert len(stream.output.outputs[0].token_ids) == 2 and engine.health().status == "ok"
    finally:
        await engine.stop()
