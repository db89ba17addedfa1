"""/v1/embeddings through the openai client: the packaged WordLlama model (its vectors those of the
package's own inference code, the wheel's files the pinned ones), strings, lists and token ids,
float and base64; a Hugging Face encoder directory by flag; bad inputs refused naming the field."""

from __future__ import annotations

import hashlib
import importlib.metadata
from base64 import b64decode, urlsafe_b64encode

import numpy as np
import openai
import pytest

from pyserve.embeddings import packaged
from pyserve.testing.in_process import serving_models

TEXTS = ["How do I reset my password?", "def add(a, b): return a + b", "The quick brown fox"]


@pytest.fixture()
async def client(llama_dir):
    async with serving_models({"tiny": {"model": str(llama_dir), "block_size": 4, "num_kv_blocks": 16}}) as (_, http):
        yield openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=http, max_retries=0), http


def test_the_wheel_holds_the_pinned_model_files():
    assert importlib.metadata.version(packaged.PACKAGE) == packaged.VERSION
    record = {str(f): f.hash for f in importlib.metadata.files(packaged.PACKAGE) if f.hash is not None}
    for relative, sha256 in (packaged.WEIGHTS, packaged.TOKENIZER):
        recorded = record[f"{packaged.PACKAGE}/{relative}"]
        assert recorded.mode == "sha256"
        assert recorded.value == urlsafe_b64encode(bytes.fromhex(sha256)).decode().rstrip("=")
        data = packaged.package_file(relative, sha256).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha256


async def test_vectors_are_the_packages_own_and_both_encodings_agree(client):
    from safetensors.numpy import load_file
    from wordllama.inference import WordLlamaInference
    from wordllama.tokenizers import tokenizer_from_file

    api, _ = client
    table = load_file(str(packaged.package_file(*packaged.WEIGHTS)))["embedding.weight"]
    reference = WordLlamaInference(table, tokenizer_from_file("l2_supercat_tokenizer_config.json"))
    want = reference.embed(TEXTS, norm=True)
    floats = await api.embeddings.create(model=packaged.NAME, input=TEXTS)
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == packaged.NAME
    got = np.array([d.embedding for d in floats.data], dtype=np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    b64 = await api.embeddings.create(model=packaged.NAME, input=TEXTS, encoding_format="base64")
    assert b"".join(b64decode(d.embedding) for d in b64.data) == got.astype("<f4").tobytes()
    ids = [reference.tokenizer.encode(t, add_special_tokens=False).ids for t in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    by_ids = await api.embeddings.create(model=packaged.NAME, input=ids)
    assert np.array([d.embedding for d in by_ids.data], dtype=np.float32).tobytes() == got.tobytes()
    one = await api.embeddings.create(model=packaged.NAME, input=ids[0])
    assert one.data[0].embedding == floats.data[0].embedding
    cards = (await api.models.list()).data
    assert [c.id for c in cards] == ["tiny", packaged.NAME]


@pytest.mark.parametrize("body, status, param", [
    ({"input": "a " * 9000}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [[1, 2], [99999]]}, 400, "input"),
    ({"input": "x", "dimensions": 64}, 400, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "pooling": "max"}, 400, "pooling"),
    ({"input": "x", "model": "tiny"}, 404, "model"),
])
async def test_bad_input_is_refused_naming_the_field_and_the_server_carries_on(client, body, status, param):
    _, http = client
    r = await http.post("/v1/embeddings", json={"model": packaged.NAME} | body)
    assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text
    ok = await http.post("/v1/embeddings", json={"model": packaged.NAME, "input": "still here"})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 256


@pytest.mark.parametrize("body, status, says", [
    ({"input": ["a", ""]}, 400, "input: input 1 is empty"),
    ({"input": "x", "model": "tiny"}, 404, f"model 'tiny' is not an embedding model; this server embeds with "
                                           f"the embedding model {packaged.NAME!r}"),
    ({"input": "x", "model": "nope"}, 404, "model 'nope' does not exist"),
])
async def test_refusals_say_what_is_wrong(client, body, status, says):
    _, http = client
    r = await http.post("/v1/embeddings", json={"model": packaged.NAME} | body)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text


async def test_a_hugging_face_encoder_directory_by_flag(tmp_path, llama_dir):
    import torch
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tmp_path / "tiny-encoder"
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "how", "do", "i", "reset", "my",
                                         "password", "?", "the", "fox"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", model_max_length=32)
    fast.save_pretrained(directory)
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=32, max_position_embeddings=32)).eval()
    model.save_pretrained(directory)
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')
    texts = ["how do i reset my password ?", "the fox"]
    with torch.inference_mode():
        enc = fast(texts, padding=True, return_tensors="pt")
        cls = model(**enc).last_hidden_state[:, 0]
        want = torch.nn.functional.normalize(cls, dim=-1).numpy()
    async with serving_models({"tiny": {"model": str(llama_dir), "block_size": 4, "num_kv_blocks": 16}},
                              embedding_model=str(directory)) as (_, http):
        api = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=http, max_retries=0)
        out = await api.embeddings.create(model="tiny-encoder", input=texts)
        np.testing.assert_allclose(np.array([d.embedding for d in out.data]), want, atol=1e-5)
        r = await http.post("/v1/embeddings", json={"model": "tiny-encoder", "input": "the " * 40})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "input")
