"""The CLI's own parsing (--lora-modules entries, the two subcommands) and `serve`'s start: the
socket answers while the model loads, and a model that fails to load ends the process with 1."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import version

import httpx
import pytest

from pyserve.cli import build_parser, lora_module, main
from pyserve.default_model import ADAPTER_DIRS
from pyserve.server.settings import ServerSettings
from pyserve.testing import copy_model


def test_lora_module_takes_name_equals_path_or_an_embedded_short_name():
    assert lora_module("mine=/srv/a=b") == ("mine", "/srv/a=b")
    assert lora_module("tests") == ("tests", str(ADAPTER_DIRS["tests"]))
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=PATH"):
        lora_module("nope")


def test_version_is_the_installed_distributions(capsys):
    import pyserve

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert (done.value.code, capsys.readouterr().out) == (0, f"pyserve {version('pyserve')}\n")
    assert pyserve.__version__ == version("pyserve") != ""


def test_batch_needs_its_files_and_serve_its_address():
    args = build_parser().parse_args(["batch", "--input", "in.jsonl", "--output", "out.jsonl", "--max-num-seqs", "8"])
    assert (args.input, args.output, args.max_num_seqs, args.served_model_name) == ("in.jsonl", "out.jsonl", 8, None)
    args = build_parser().parse_args(["serve", "--port", "9000", "--lora-modules", "tests"])
    assert (args.host, args.port, args.lora_modules) == ("127.0.0.1", 9000, [("tests", str(ADAPTER_DIRS["tests"]))])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["batch", "--input", "in.jsonl"])
    for abbreviated in (["serve", "--data-parallel", "2"], ["router", "--replica", "http://a", "--pol", "round_robin"]):
        with pytest.raises(SystemExit):  # flags only by their full names (a replica would start replicas)
            build_parser().parse_args(abbreviated)


def test_bad_addresses_sizes_and_combinations_are_refused_before_anything_loads(tmp_path, capsys):
    for argv in (["serve", "--port", "70000"], ["router", "--replica", "http://a", "--port", "-1"],
                 ["serve", "--shutdown-timeout", "-5"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
    from pyserve.replicas.settings import RouterSettings

    for urls, match in ((["http://h:1", "http://h:1/"], "twice"), (["http://h:1/v1"], "without /v1")):
        with pytest.raises(ValueError, match=match):
            RouterSettings(replica=urls)
    for field, value in (("max_body_bytes", 0), ("max_waiting", 0)):
        with pytest.raises(ValueError, match=field):
            ServerSettings(served_model_name="m", **{field: value})
    with pytest.raises(SystemExit, match="--data-dir"):
        main(["serve", "--data-parallel-size", "2", "--data-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--served-model-name names the positional MODEL"):
        main(["serve", "--served-model-name", "foo", "--model", f"small={tmp_path}"])
    (tmp_path / "in.jsonl").write_text("")
    with pytest.raises(SystemExit, match="--output"):
        main(["batch", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "missing" / "out.jsonl")])


def _serve(model_dir, workdir, python_flags=(), extra=()):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (workdir / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, *python_flags, "-m", "pyserve.cli", "serve", str(model_dir), "--port",
                             str(port), "--num-kv-blocks", "64", "--block-size", "4", *extra], stdout=log,
                            stderr=subprocess.STDOUT, cwd=workdir)
    return proc, f"http://127.0.0.1:{port}", workdir / "serve.log"


def _events(log_path) -> dict[str, dict]:
    return {e["event"]: e for e in (json.loads(ln) for ln in log_path.read_text().splitlines() if ln.startswith("{"))}


def test_serve_answers_loading_while_the_engine_loads_then_ok(llama_dir, tmp_path):
    """The socket is bound before torch is imported: the first answer is the 503 "loading"."""
    proc, base, log_path = _serve(llama_dir, tmp_path)
    answers = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.get(base + "/health", timeout=5)
            except httpx.HTTPError:
                time.sleep(0.01)
                continue
            if not answers or answers[-1] != (r.status_code, r.json()):
                answers.append((r.status_code, r.json()))
            if r.status_code == 200:
                break
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert answers == [(503, {"status": "loading"}), (200, {"status": "ok"})]
    events = _events(log_path)
    loaded, ready = events["engine_loaded"], events["server_ready"]
    assert 0 < loaded["torch_import_seconds"] < ready["seconds"] and ready["kv_blocks"] == 64
    assert events["weights_loaded"]["in_place"] == events["weights_loaded"]["tensors"] > 0


def test_serve_exits_non_zero_when_the_model_fails_to_load(llama_dir, tmp_path):
    model = copy_model(llama_dir, tmp_path / "no-weights")
    (model / "model.safetensors").unlink()
    proc, _, log_path = _serve(model, tmp_path)
    assert proc.wait(timeout=120) == 1
    log = log_path.read_text()
    assert "server_load_failed" in _events(log_path)
    assert "pyserve serve: the model failed to load: WeightsError" in log and "no *.safetensors" in log


def test_a_file_that_cannot_be_served_fails_before_the_server_is_imported(tmp_path):
    """A local model's config is read (without torch) before the server's modules are imported and
    its socket bound: a bad file ends the start without the seconds those take."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(60))
    proc, _, log_path = _serve(bad, tmp_path, python_flags=("-X", "importtime"))
    assert proc.wait(timeout=120) == 1
    log = log_path.read_text()
    assert "the model failed to load: WeightsError" in log and "is not a readable GGUF file" in log
    imported = [ln.rsplit("|", 1)[1].strip() for ln in log.splitlines() if ln.startswith("import time:")]
    assert "server_load_failed" in _events(log_path)
    assert "pyserve.model.checkpoint" in imported and "pyserve.server.app" not in imported and "torch" not in imported


def test_a_context_past_the_models_fails_before_torch_is_imported(llama_dir, tmp_path):
    proc, _, log_path = _serve(llama_dir, tmp_path, python_flags=("-X", "importtime"), extra=("--max-model-len", "100000"))
    assert proc.wait(timeout=120) == 1
    log = log_path.read_text()
    assert "max_model_len 100000 is longer than the model's context of 512 tokens" in log
    imported = [ln.rsplit("|", 1)[1].strip() for ln in log.splitlines() if ln.startswith("import time:")]
    assert "torch" not in imported


def test_a_bad_speculative_config_fails_before_torch_is_imported(llama_dir, tmp_path):
    """Each refusal names its key, before the server's imports: a method pyserve lacks, vLLM's
    older n-gram spelling, a draft that is no model."""
    for config, message in (({"method": "medusa"}, "speculative_config.method must be one of"),
                            ({"model": "[ngram]"}, 'spelled "method": "ngram"'),
                            ({"method": "draft_model", "model": str(tmp_path)},
                             "is neither a model directory (config.json), a GGUF file nor a hub id")):
        proc, _, log_path = _serve(llama_dir, tmp_path, python_flags=("-X", "importtime"),
                                   extra=("--speculative-config", json.dumps(config)))
        assert proc.wait(timeout=120) == 1
        log = log_path.read_text()
        assert "pyserve serve: speculative_config." in log and message in log
        imported = [ln.rsplit("|", 1)[1].strip() for ln in log.splitlines() if ln.startswith("import time:")]
        assert "torch" not in imported and "pyserve.server.app" not in imported
