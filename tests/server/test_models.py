"""Several models in one server: each name answered by its own engine, listed by /v1/models,
per-model metric series, unknown names 404; the models the CLI's flags and models file ask for,
with the KV budget split by share; with no model, the embedded target and draft as a pair."""

from __future__ import annotations

import pytest
import torch

from pyserve.cli import _served_models, build_parser
from pyserve.default_model import DEFAULT_MODEL_NAME, DRAFT_DIR, TARGET_DIR
from pyserve.embeddings.packaged import NAME as PACKAGED_EMBEDDING_MODEL, WEIGHTS, package_file as packaged_file
from pyserve.engine.llm import LLM
from pyserve.step.sampling_params import SamplingParams
from pyserve.model.config import ModelConfig
from pyserve.model.kv_cache import auto_num_blocks
from pyserve.server.model_specs import DRAFT_MODEL_NAME, ModelEntry, ModelsConfigError, engine_configs, load_models_file
from pyserve.testing import parse_metrics
from pyserve.testing.in_process import serving_models

PROMPT = [5, 9, 17, 33, 60]


def _greedy(model_dir) -> list[int]:
    with LLM(str(model_dir), block_size=4, num_kv_blocks=64) as llm:
        out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def want(model_dirs) -> dict[str, list[int]]:
    """Each model's greedy tokens, served alone (offline)."""
    return {"a": _greedy(model_dirs["llama"]), "b": _greedy(model_dirs["qwen2"])}


@pytest.mark.asyncio
async def test_each_name_is_answered_by_its_own_model(model_dirs, want):
    assert want["a"] != want["b"]
    models = {"a": {"model": str(model_dirs["llama"]), "block_size": 4, "num_kv_blocks": 64},
              "b": {"model": str(model_dirs["qwen2"]), "block_size": 4, "num_kv_blocks": 32}}
    async with serving_models(models) as (engines, client):
        cards = (await client.get("/v1/models")).json()["data"]
        assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
            ("a", str(model_dirs["llama"]), None), ("b", str(model_dirs["qwen2"]), None),
            (PACKAGED_EMBEDDING_MODEL, str(packaged_file(*WEIGHTS)), None)]
        for name in ("a", "b"):
            r = await client.post("/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 6,
                                                           "temperature": 0, "ignore_eos": True, "logprobs": 0})
            assert r.status_code == 200 and r.json()["model"] == name
            tokens = r.json()["choices"][0]["logprobs"]["tokens"]
            assert tokens == [engines[name].tokenizer.decode([t]) for t in want[name]]
        metrics = parse_metrics((await client.get("/metrics")).text)
        assert metrics['pyserve:kv_total_blocks{model="a"}'] == 64 and metrics['pyserve:kv_total_blocks{model="b"}'] == 32
        assert metrics['pyserve:generation_tokens_total{model="a"}'] == 6
        assert metrics['pyserve:generation_tokens_total{model="b"}'] == 6
        for name in ("a", "b"):  # latency and outcomes per model too
            assert metrics[f'pyserve:time_to_first_token_seconds_count{{model="{name}"}}'] == 1
            assert metrics[f'pyserve:inter_token_latency_seconds_count{{model="{name}"}}'] == 5
            assert metrics[f'pyserve:request_outcomes_total{{model="{name}",outcome="ok"}}'] == 1
        stats = (await client.get("/v1/stats")).json()
        assert stats["latency"]["ttft"]["count"] == 2  # /v1/stats sums the models
        assert stats["outcomes"] == {"ok": 2}
        r = await client.post("/v1/completions", json={"model": "c", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert "'a', 'b'" in r.json()["error"]["message"]
        r = await client.post("/tokenize", json={"model": "b", "prompt": "x y"})
        assert r.json()["tokens"] == engines["b"].tokenizer.encode("x y")


@pytest.mark.asyncio
async def test_a_models_own_output_caps_replace_the_flags_key_by_key(model_dirs):
    models = {"a": {"model": str(model_dirs["llama"]), "block_size": 4, "num_kv_blocks": 64},
              "b": {"model": str(model_dirs["qwen2"]), "block_size": 4, "num_kv_blocks": 32}}
    async with serving_models(models, policies={"a": {"default_max_tokens": 2, "max_tokens_limit": 4}},
                              default_max_tokens=3) as (_, client):
        async def ask(name, **body):
            return await client.post("/v1/completions", json={"model": name, "prompt": PROMPT, "temperature": 0,
                                                              "ignore_eos": True, **body})
        for name, want in (("a", 2), ("b", 3)):
            r = (await ask(name)).json()
            assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (want, "length")
        r = await ask("a", max_tokens=5)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert "limit of 4 for 'a'" in r.json()["error"]["message"]
        assert (await ask("b", max_tokens=5)).json()["usage"]["completion_tokens"] == 5  # b has no limit


def test_the_kv_budget_is_split_by_share_and_flags_apply_to_every_model(tmp_path):
    configs = engine_configs([ModelEntry("big", "/m/big", kv_share=3), ModelEntry("small", "/m/small")],
                             {"max_num_seqs": 8})
    assert {n: (c.model, c.kv_cache_share, c.max_num_seqs) for n, (c, _) in configs.items()} == {
        "big": ("/m/big", 0.75, 8), "small": ("/m/small", 0.25, 8)}
    cfg = ModelConfig.from_dir(TARGET_DIR)
    whole = auto_num_blocks(cfg, 16, torch.float32, torch.device("cpu"), 0.85)
    assert auto_num_blocks(cfg, 16, torch.float32, torch.device("cpu"), 0.85, 0.25) == whole // 4
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - {name: x, model: /m/x, max_num_seqs: 4, lora_modules: {sql: /a/sql},"
                    " max_tokens_limit: 64}\n")
    (entry,) = load_models_file(path)
    config, loras = engine_configs([entry], {"max_num_seqs": 8})["x"]
    assert (config.max_num_seqs, config.enable_lora, config.kv_cache_share, loras) == (4, True, 1.0, {"sql": "/a/sql"})
    assert entry.policy == {"max_tokens_limit": 64}


@pytest.mark.parametrize("text, message", [
    ("models:\n  - {name: x, model: /m, colour: red}\n", "models[0]: unknown key 'colour'"),
    ("models:\n  - {model: /m}\n", "models[0]: name must be a non-empty string"),
    ("models:\n  - {name: x, model: /m, kv_share: 0}\n", "models[0]: kv_share must be a positive number"),
    ("routes: []\n", "must be a mapping with one key, models"),
    ("models:\n  - {name: x, model: /m, max_tokens_limit: 0}\n", "models[0]: max_tokens_limit must be an int of at"),
    ("models:\n  - {name: x, model: /m, concise: 1}\n", "models[0]: concise must be true or false"),
    ("models:\n  - {name: x, model: /m, max_prompt_tokens: 0}\n", "models[0]: max_prompt_tokens must be an int of"),
    ("models:\n  - {name: x, model: /m, prompt_policy: newest}\n", "models[0]: prompt_policy must be one of turns,"),
    ("models:\n  - {name: x, model: /m, default_max_tokens: 9, max_tokens_limit: 4}\n",
     "models[0]: default_max_tokens .9. must not exceed max_tokens_limit .4."),
])
def test_a_bad_models_file_is_refused_naming_the_entry_and_key(tmp_path, text, message):
    path = tmp_path / "models.yaml"
    path.write_text(text)
    with pytest.raises(ModelsConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_models_file(path)


def test_a_bad_value_or_a_repeated_name_is_refused_naming_the_model():
    with pytest.raises(ModelsConfigError, match="model 'x': max_num_seqs must be at least 1"):
        engine_configs([ModelEntry("x", "/m", overrides={"max_num_seqs": 0})], {})
    with pytest.raises(ModelsConfigError, match="model 'x' is given twice"):
        engine_configs([ModelEntry("x", "/m"), ModelEntry("x", "/n")], {})


def test_with_no_model_the_embedded_target_and_draft_are_served_as_a_pair():
    args = build_parser().parse_args(["serve", "--speculative-config", '{"method": "ngram"}'])
    specs = _served_models(args)
    assert list(specs) == [DEFAULT_MODEL_NAME, DRAFT_MODEL_NAME]
    args = build_parser().parse_args(["serve", "--model", f"other={DRAFT_DIR}", "--num-kv-blocks", "8"])
    assert list(_served_models(args)) == ["other"]
    with pytest.raises(SystemExit, match="--model 'nodir': use NAME=DIR"):
        _served_models(build_parser().parse_args(["serve", "--model", "nodir"]))


def test_the_command_line_models_become_engine_configs():
    from pyserve.server import model_specs

    args = build_parser().parse_args(["serve", str(TARGET_DIR), "--model", f"small={DRAFT_DIR}",
                                      "--speculative-config", '{"method": "ngram"}'])
    entries = [ModelEntry("target", str(TARGET_DIR)), ModelEntry("small", str(DRAFT_DIR))]
    assert list(_served_models(args)) == ["target", "small"]
    configs = engine_configs(entries, {"speculative_config": '{"method": "ngram"}'})
    assert [c.kv_cache_share for c, _ in configs.values()] == [0.5, 0.5]
    pair = engine_configs(model_specs.default_pair(), {"speculative_config": '{"method": "ngram"}'})
    assert [c.speculative_config for c, _ in pair.values()] == ['{"method": "ngram"}', None]
