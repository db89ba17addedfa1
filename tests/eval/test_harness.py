"""`pyserve eval` end to end on the embedded family, in its quick form: the example configurations
over the first items of the shipped eval set, the report's files and figures, a failing
configuration reported beside the others, a running server's key taken from the environment,
and bad configs refused naming the key."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pyserve.default_model.training import corpus
from pyserve.eval.configs import ConfigsError, load_plan
from pyserve.eval.harness import clipped, label_offsets
from pyserve.eval.items import load_eval_set
from pyserve.testing import start_server, stop_server

DATA = Path(__import__("pyserve.eval", fromlist=["x"]).__file__).with_name("data")


def test_the_shipped_set_is_drawn_from_held_out_modules_only():
    items = load_eval_set(DATA / "embedded.jsonl")
    kinds = {i.scorer for i in items}
    assert kinds == {"regex", "line_prefix", "choice", "perplexity", "code"}
    held = {"csv.py", "fractions.py", "json", "shlex.py", "textwrap.py"}
    assert held == set(corpus.HELD_OUT)
    for item in items:
        if item.scorer != "code":
            assert Path(item.source).parts[0] in held, item.id


def test_the_example_configs_parse():
    plan = load_plan(DATA / "embedded_configs.yaml")
    assert len(plan.configs) == 8
    int8 = next(c for c in plan.configs if c.name == "target-int8")
    assert int8.engine == {"quantization": "int8"} and int8.serve_flags() == ["--quantization", "int8"]


def test_the_real_model_example_parses_and_serves_the_pair_it_names():
    plan = load_plan(DATA / "real_models_configs.yaml")
    configs = {c.name: c for c in plan.configs}
    assert len(configs) == 7
    home = str(Path.home())
    assert configs["qwen-1.5b"].model == f"{home}/.cache/pyserve/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    cascade = configs["cascade-0.5b-1.5b"]
    assert cascade.serve_flags()[:2] == ["--model", f"small={home}/.cache/pyserve/models/"
                                                    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"]
    assert cascade.serve_flags()[2:4] == ["--cascade", "eval=small,large,-0.04"]
    assert configs["llama-server-1.5b"].url == "http://127.0.0.1:8091/v1"


def test_the_levers_example_parses_into_caps_and_concise():
    plan = load_plan(DATA / "levers_configs.yaml")
    configs = {c.name: c for c in plan.configs}
    assert [configs[f"cap-{n}"].max_tokens for n in (512, 256, 128)] == [512, 256, 128]
    assert configs["no-cap"].serve_flags() == [] and configs["concise"].serve_flags() == ["--concise"]
    assert len(configs) == 5


def test_switches_become_flags_only_where_they_change_the_default():
    from pyserve.eval.configs import EvalConfig

    widened = EvalConfig(name="w", model="m.gguf", gguf_dequantize=True, quantization="int4")
    assert widened.serve_flags() == ["--quantization", "int4", "--gguf-dequantize"]
    assert EvalConfig(name="n", model="m.gguf", gguf_dequantize=False).serve_flags() == []
    assert EvalConfig(name="c", model="m", enable_prefix_caching=False).serve_flags() == ["--no-prefix-caching"]
    assert EvalConfig(name="c", model="m", enable_prefix_caching=True).serve_flags() == []


def test_decision_keys_become_serve_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("configs:\n  - {name: r, route: r.json, semantic_cache: true}\n"
                    "  - {name: c, cascade: {min_logprob: -1.5}}\n")
    routed, cascade = load_plan(path).configs
    assert routed.decides and routed.serve_flags() == ["--route", "eval=r.json", "--semantic-cache"]
    assert cascade.serve_flags() == ["--cascade", "eval=pyserve-default-draft,pyserve-default,-1.5"]


def test_the_concise_keys_become_serve_flags_and_are_refused_where_they_cannot_apply():
    from pyserve.eval.configs import EvalConfig

    assert EvalConfig(name="c", concise=True, concise_instruction="Be brief.").serve_flags() == [
        "--concise", "--concise-instruction", "Be brief."]
    assert EvalConfig(name="d", concise=True).serve_flags() == ["--concise"]
    with pytest.raises(ValueError, match="concise_instruction: given without concise: true"):
        EvalConfig(name="e", concise_instruction="Be brief.")
    with pytest.raises(ValueError, match="concise and the prompt budget do not apply"):
        EvalConfig(name="f", url="http://127.0.0.1:1/v1", concise=True)


def test_the_prompt_budget_keys_become_serve_flags_and_are_refused_where_they_cannot_apply():
    from pyserve.eval.configs import EvalConfig

    assert EvalConfig(name="b", max_prompt_tokens=1024, prompt_policy="turns+repeats").serve_flags() == [
        "--max-prompt-tokens", "1024", "--prompt-policy", "turns+repeats"]
    assert EvalConfig(name="c", max_prompt_tokens=512).serve_flags() == ["--max-prompt-tokens", "512"]
    with pytest.raises(ValueError, match="prompt_policy: given without max_prompt_tokens"):
        EvalConfig(name="d", prompt_policy="turns")
    with pytest.raises(ValueError, match="prompt_policy"):
        EvalConfig(name="e", max_prompt_tokens=512, prompt_policy="newest")
    with pytest.raises(ValueError, match="the prompt budget do not apply"):
        EvalConfig(name="f", url="http://127.0.0.1:1/v1", max_prompt_tokens=512)


def test_a_cascade_over_models_of_ones_own_serves_them_all_with_home_paths_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "c.yaml"
    path.write_text("configs:\n  - {name: c, model: ~/big.gguf, served_model: big, models: {small: ~/s.gguf},\n"
                    "      cascade: {small: small, large: big, min_logprob: -0.3}}\n"
                    "  - {name: r, model: ~/big.gguf, served_model: big, models: {small: ~/s.gguf}, route: ~/r.json}\n"
                    "  - {name: l, model: ~/big.gguf, lora: a=~/adapter}\n")
    cascade, routed, adapted = load_plan(path).configs
    assert cascade.model == str(tmp_path / "big.gguf")
    assert cascade.serve_flags() == ["--model", f"small={tmp_path / 's.gguf'}", "--cascade", "eval=small,big,-0.3"]
    assert routed.serve_flags() == ["--model", f"small={tmp_path / 's.gguf'}", "--route", f"eval={tmp_path / 'r.json'}"]
    assert adapted.serve_flags() == ["--enable-lora", "--lora-modules", f"a={tmp_path / 'adapter'}"]


@pytest.mark.parametrize("text, message", [
    ("configs: []", "configs: List should have at least 1 item"),
    ("configs:\n  - {name: a, route: x, model: embedded:draft}", r"configs\[0\] \(a\): served_model: a route or cascade"),
    ("configs:\n  - {name: a, route: x, lora: docstrings}", r"configs\[0\] \(a\): lora: a route or cascade chooses"),
    ("configs:\n  - {name: a, model: m, served_model: m}", r"configs\[0\] \(a\): served_model: a local config"),
    ("configs:\n  - {name: a, model: m, served_model: big, models: {small: s}, cascade: {small: smal, large: big, "
     "min_logprob: -1}}", r"configs\[0\] \(a\): cascade: small: 'smal' is not a model this configuration serves "
     r"\(big, small\)"),
    ("configs:\n  - {name: a, url: 'http://x', models: {s: s}}", "a url configuration is already running"),
    ("configs:\n  - {name: a, model: m, models: {s: s}}", r"configs\[0\] \(a\): models: only a route or cascade"),
    ("configs:\n  - {name: a, served_model: x, cascade: {min_logprob: -1}}", r"served_model: the embedded pair"),
    ("configs:\n  - {name: a, route: x, cascade: {min_logprob: -1}}", r"configs\[0\] \(a\): .*route or cascade"),
    ("configs:\n  - {name: a, cascade: {}}", r"configs\[0\] \(a\): cascade.min_logprob: Field required"),
    ("configs:\n  - {name: a, temprature: 0.5}", r"configs\[0\] \(a\): temprature: Extra inputs"),
    ("configs:\n  - {name: a}\n  - {name: a}", "the name 'a' is used twice"),
    ("configs:\n  - {name: a, prompt_template: 'x'}", r"configs\[0\] \(a\): prompt_template: must contain \{prompt\}"),
    ("configs:\n  - {name: a, url: 'http://x', quantization: int8}", "a url configuration is already running"),
    ("configs:\n  - {name: a, api_key_env: HOME}", r"configs\[0\] \(a\): .*only a url configuration takes a key"),
    ("configs:\n  - {name: a, url: 'http://x', api_key_env: PYSERVE_UNSET_KEY}",
     "the environment variable PYSERVE_UNSET_KEY is not set"),
    ("configs: [", "not valid YAML"),
])
def test_bad_configs_name_the_configuration_and_key(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigsError, match=message):
        load_plan(path)


def test_quick_run_of_the_example_and_a_failing_configuration(tmp_path):
    configs = tmp_path / "configs.yaml"
    example = (DATA / "embedded_configs.yaml").read_text()
    broken = "  - name: broken\n    model: embedded:target\n    quantization: int3\n"
    cascade = "  - name: cascade\n    cascade: {min_logprob: -3.0}\n"  # over the embedded pair
    configs.write_text(example + cascade + broken)
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "pyserve.cli", "eval", "--data", str(DATA / "embedded.jsonl"),
                          "--configs", str(configs), "--out", str(out), "--limit", "6"],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    rows = {c["name"]: c for c in report["configs"]}
    assert list(rows) == ["target", "target-int8", "target-int4", "draft", "target-ngram", "target-draft-spec",
                          "target-docstrings", "target-cap-16", "cascade", "broken"]
    assert rows["broken"]["status"] == "failed" and "quantization must be one of" in rows["broken"]["error"]
    for name, row in rows.items():
        if name == "broken":
            continue
        assert row["status"] == "ok" and row["items"] == 6, row
        assert 0.0 <= row["ci_low"] <= row["quality"] <= row["ci_high"] <= 1.0
        assert row["output_tokens"] > 0 and row["dollars_per_mtok"] > 0 and row["ttft_p50_ms"] > 0
        assert row["e2e_p50_s"] > 0 and row["output_tok_s"] > 0
    assert any(row["frontier"] for row in rows.values())
    first = rows["target"]["results"]
    assert [r["id"] for r in first] == [i.id for i in load_eval_set(DATA / "embedded.jsonl")[:6]]
    assert all(r["score"] in (0.0, 1.0) for r in first)
    assert report["machine"]["python"] and report["items"] == 6
    with (out / "eval.csv").open() as f:
        assert [r["name"] for r in csv.DictReader(f)] == list(rows)
    assert (out / "eval.png").stat().st_size > 1000
    assert "target-int8" in run.stdout and "failed broken" in run.stdout


def test_a_bad_eval_line_stops_the_cli_before_any_server_starts(tmp_path):
    data = tmp_path / "eval.jsonl"
    data.write_text('{"id": "a", "prompt": "x", "scorer": "exact", "reference": "y"}\n{"id": "b", "prompt": "x"}\n')
    run = subprocess.run([sys.executable, "-m", "pyserve.cli", "eval", "--data", str(data), "--configs",
                          str(DATA / "embedded_configs.yaml"), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode != 0 and "eval.jsonl line 2: scorer: missing" in run.stderr
    assert not (tmp_path / "out").exists()


def test_plot_labels_at_one_point_are_stacked_and_lone_ones_stay_put():
    # three configurations at one point, one a little right of them (under their labels), one far
    anchors = [(100.0, 50.0), (100.0, 50.0), (101.0, 50.0), (110.0, 52.0), (400.0, 50.0)]
    widths = [60.0, 60.0, 60.0, 60.0, 60.0]
    offsets = label_offsets(anchors, widths, 10.0)
    assert offsets[:3] == [0.0, 10.0, -10.0] and offsets[4] == 0.0
    boxes = [(x, x + w, y + dy) for (x, y), w, dy in zip(anchors, widths, offsets)]
    for i, (l1, r1, b1) in enumerate(boxes):
        for l2, r2, b2 in boxes[i + 1:]:
            assert l1 >= r2 or l2 >= r1 or abs(b1 - b2) >= 10.0, (i, offsets)


def test_a_failure_keeps_the_end_of_its_message_and_a_run_where_all_failed_exits_non_zero(tmp_path):
    message = "usage: " + "x" * 5000 + " error: the reason"
    short = clipped(message)
    assert len(short) < 2100 and short.startswith("usage: ") and short.endswith("error: the reason")
    assert clipped("short") == "short"
    configs = tmp_path / "c.yaml"
    configs.write_text("configs:\n  - {name: gone, url: 'http://127.0.0.1:9'}\n")
    run = subprocess.run([sys.executable, "-m", "pyserve.cli", "eval", "--data", str(DATA / "embedded.jsonl"),
                          "--configs", str(configs), "--out", str(tmp_path / "out"), "--limit", "1"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 1 and "every configuration failed" in run.stderr
    assert "failed gone" in run.stdout


def test_a_url_configuration_presents_the_key_from_its_environment_variable(tmp_path):
    """...and keeps out of the server's semantic cache: a replayed answer is no measure of it."""
    proc, base = start_server(None, "--api-key", "sekret", "--semantic-cache", workdir=tmp_path)
    try:
        data = tmp_path / "chat.jsonl"
        data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": "def add(a, b):"}],
                                            "max_tokens": 8, "scorer": "contains", "reference": "return"}) + "\n"
                                for i in range(2)))
        configs = tmp_path / "c.yaml"
        configs.write_text(f"configs:\n  - {{name: keyed, url: '{base}/v1', served_model: pyserve-default, "
                           f"api_key_env: EVAL_TEST_KEY}}\n  - {{name: keyless, url: '{base}/v1', "
                           f"served_model: pyserve-default}}\n")
        run = subprocess.run([sys.executable, "-m", "pyserve.cli", "eval", "--data", str(data),
                              "--configs", str(configs), "--out", str(tmp_path / "out")],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path,
                             env={**os.environ, "EVAL_TEST_KEY": "sekret"})
        cache = httpx.get(base + "/v1/cache", headers={"Authorization": "Bearer sekret"}).json()
    finally:
        stop_server(proc)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (cache["stores"], cache["hits"]) == (0, 0)  # the same chat four times (warm-up, items): never cached
    rows = {c["name"]: c for c in json.loads((tmp_path / "out" / "eval.json").read_text())["configs"]}
    assert rows["keyed"]["status"] == "ok" and rows["keyed"]["items"] == 2
    assert rows["keyless"]["status"] == "failed" and "401" in rows["keyless"]["error"]
