"""`pyserve serve --quantization int8` on the embedded model: it serves, /metrics shows the
quantized weight bytes and the method, and an unknown method stops the start with the field
named; a pre-quantized (GPTQ) checkpoint serves over HTTP and through `pyserve batch` with the
tokens the offline engine gives it."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from pyserve import LLM, SamplingParams
from pyserve.testing import scrape_metrics, start_server, stop_server
from pyserve.testing.quantized_checkpoints import write_quantized


def test_an_int8_server_serves_and_reports_its_weight_bytes(tmp_path):
    proc, base = start_server(None, "--quantization", "int8", workdir=tmp_path)
    try:
        r = httpx.post(base + "/v1/completions", timeout=60,
                       json={"model": "pyserve-default", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        metrics = scrape_metrics(base, model="pyserve-default")
        assert metrics["pyserve:weight_bytes"] < 0.55 * 16_786_432
        assert metrics['pyserve:weight_quantization_info{method="int8"}'] == 1
    finally:
        stop_server(proc)


def test_an_unknown_method_stops_the_start_naming_the_field(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pyserve.cli", "serve", "--quantization", "int3", "--port", "0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert "quantization must be one of int8" in proc.stdout + proc.stderr


def test_a_gptq_checkpoint_serves_over_http_and_in_a_batch_file(model_dirs, tmp_path):
    model = tmp_path / "gptq"
    write_quantized(model_dirs["llama"], model, tmp_path / "ref", "gptq", 4, 32, False, True)
    prompt = [5, 9, 17, 33, 60]
    with LLM(str(model), block_size=4, num_kv_blocks=128) as llm:
        want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    body = {"model": "gptq", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    proc, base = start_server(model, "--block-size", "4", "--num-kv-blocks", "128", workdir=tmp_path)
    try:
        r = httpx.post(base + "/v1/completions", timeout=60, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        assert scrape_metrics(base, model="gptq")['pyserve:weight_quantization_info{method="gptq-int4"}'] == 1
    finally:
        stop_server(proc)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "q", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    run = subprocess.run([sys.executable, "-m", "pyserve.cli", "batch", str(model), "--input", str(src), "--output",
                          str(dst), "--block-size", "4", "--num-kv-blocks", "128"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads(dst.read_text())
    assert record["response"]["status_code"] == 200
    assert record["response"]["body"]["choices"][0]["text"] == want
