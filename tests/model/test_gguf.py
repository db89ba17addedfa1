"""GGUF files (pyserve/model/gguf): tiny models written as llama.cpp writes them serve what their
Hugging Face directories serve; block formats become layers holding the file's own weights; files
pyserve cannot serve are refused naming the cause."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pyserve import LLM, SamplingParams
from pyserve.model.checkpoint import load_config, load_tokenizer
from pyserve.model.config import UnsupportedModelError
from pyserve.model.errors import WeightsError
from pyserve.model.gguf import gguf_path
from pyserve.model.gguf.blocks import BLOCK_SIZES
from pyserve.model.gguf.tokenizer import build_tokenizer
from pyserve.model.block_embedding import BlockEmbedding
from pyserve.model.gguf.weights import int8_rows, q4_blocks
from pyserve.model.kquant_linear import KQuantLinear
from pyserve.model.loader import load_model
from pyserve.model.quantized_linear import Int4Linear, Int8Linear, quantize_int8, weight_bytes
from pyserve.speculative.config import SpeculativeConfig
from pyserve.testing import build_model
from pyserve.testing.tiny_gguf import LLAMA_ROPE, gguf_from_hf, gguf_rewritten

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
TEXT = "hello world 123, the cat"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model of each family whose GGUF files can hold its RoPE (no llama3 scaling)."""
    root = tmp_path_factory.mktemp("gguf")
    return {arch: build_model(root / arch, arch, **(LLAMA_ROPE if arch == "llama" else {}))
            for arch in ("llama", "qwen2", "qwen3")}


def _greedy(model, prompt_ids, **settings):
    llm = LLM(model=str(model), **settings)
    try:
        return llm.generate([prompt_ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_an_f32_gguf_serves_its_hf_directorys_greedy_tokens(tiny, tmp_path, arch):
    """Config, tensor names, llama.cpp's q/k row order (llama) and the tokenizer all round-trip."""
    hf_dir = tiny[arch]
    gguf = gguf_from_hf(hf_dir, tmp_path / "m.gguf")
    hf_tok, gguf_tok = load_tokenizer(hf_dir), load_tokenizer(gguf)
    assert gguf_tok.encode(TEXT) == hf_tok.encode(TEXT)
    chat = [{"role": "user", "content": "hi"}]
    assert gguf_tok.apply_chat_template(chat) == hf_tok.apply_chat_template(chat)
    assert (gguf_tok.eos_token, gguf_tok.bos_token) == (hf_tok.eos_token, hf_tok.bos_token)
    cfg, ref_cfg = load_config(gguf), load_config(hf_dir)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias, cfg.qk_norm) == \
        (ref_cfg.num_layers, ref_cfg.num_kv_heads, ref_cfg.head_dim, ref_cfg.qkv_bias, ref_cfg.qk_norm)
    ids = hf_tok.encode(TEXT)
    assert _greedy(gguf, ids) == _greedy(hf_dir, ids)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_formats_become_layers_holding_the_files_weights(tiny, tmp_path, kind):
    """On a CPU, blocks are served as the file holds them (gguf's widening of them, exactly); off
    it (the Triton kernels' layouts) 4-bit blocks become Int4Linear's groups (the same weights, bit
    for bit) and 8-bit ones int8 rows, each re-rounded to one scale (within half its step)."""
    gguf = gguf_from_hf(tiny["llama"], tmp_path / "m.gguf", projections=kind)
    cfg = load_config(gguf)
    native = load_model(gguf, cfg, torch.float32, torch.device("cpu"), 64, gguf_dequantize=False)
    wide = load_model(gguf, cfg, torch.float32, torch.device("cpu"), 64, gguf_dequantize=True)
    assert native.checkpoint_quantization == f"gguf-{kind}" and wide.checkpoint_quantization is None
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"):
        served, file_weight = native.get_submodule(name), wide.get_submodule(name).weight
        assert isinstance(served, KQuantLinear) and isinstance(wide.get_submodule(name), torch.nn.Linear)
        assert served.kind == kind and torch.equal(served.dequantized(), file_weight)
        if kind == "Q8_0":
            assert _within_half_a_step(Int8Linear(*int8_rows(served.parts[0].numpy(), kind), None), file_weight)
        else:
            converted = Int4Linear(*q4_blocks(served.parts[0].numpy(), kind), 32, None)
            assert torch.equal(converted.dequantized(), file_weight)


@pytest.mark.parametrize("dtype, torch_dtype", [("half", torch.float16), ("bfloat16", torch.bfloat16)])
def test_a_quantized_file_serves_in_half_precision(tmp_path, dtype, torch_dtype):
    """dtype half or bfloat16 (vLLM's keywords): the table in its blocks looks rows up in that
    dtype, so the layers and the KV cache get it (rows in f32 killed the engine at its first step)."""
    hf_dir = build_model(tmp_path / "hf", "qwen2", hidden_size=256, intermediate_size=512, tie_word_embeddings=False)
    gguf = gguf_from_hf(hf_dir, tmp_path / "q8.gguf", projections="Q8_0")
    cfg = load_config(gguf)
    gguf = _with_tensor(gguf, tmp_path / "m.gguf", "token_embd.weight", "Q4_K", _blocks("Q4_K", cfg.vocab_size, 256))
    half = load_model(gguf, cfg, torch_dtype, torch.device("cpu"), 64, gguf_dequantize=False)
    wide = load_model(gguf, cfg, torch.float32, torch.device("cpu"), 64, gguf_dequantize=True)
    ids = torch.tensor([[0, 7], [cfg.vocab_size - 1, 7]])
    assert torch.equal(half.model.embed_tokens(ids), wide.model.embed_tokens(ids).to(torch_dtype))
    prompt = load_tokenizer(gguf).encode(TEXT)
    with LLM(model=str(gguf), dtype=dtype) as llm:
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == GREEDY.max_tokens and out.finish_reason == "length"


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_a_quantized_embedding_stays_in_its_blocks_and_looks_up_the_widened_rows(tmp_path, kind):
    """On a CPU the table is the file's blocks (a BlockEmbedding): each looked-up row is gguf's
    widening of it, so greedy tokens (the prompt op by op, each decode step through the whole-model
    kernel) equal those of the table widened at load, and the weights held shrink by the f32 table
    less its blocks."""
    hf_dir = build_model(tmp_path / "hf", "qwen2", hidden_size=256, intermediate_size=512, tie_word_embeddings=False)
    gguf = gguf_from_hf(hf_dir, tmp_path / "f32.gguf")
    cfg = load_config(gguf)
    gguf = _with_tensor(gguf, tmp_path / "m.gguf", "token_embd.weight", kind, _blocks(kind, cfg.vocab_size, 256))
    native = load_model(gguf, cfg, torch.float32, torch.device("cpu"), 64, gguf_dequantize=False)
    wide = load_model(gguf, cfg, torch.float32, torch.device("cpu"), 64, gguf_dequantize=True)
    table = native.model.embed_tokens
    assert isinstance(table, BlockEmbedding) and table.kind == kind
    ids = torch.tensor([[0, 7], [cfg.vocab_size - 1, 7]])
    assert torch.equal(table(ids), wide.model.embed_tokens(ids))
    assert torch.equal(table.dequantized(), wide.model.embed_tokens.weight)
    with pytest.raises(IndexError):
        table(torch.tensor([cfg.vocab_size]))
    assert weight_bytes(wide) - weight_bytes(native) == 4 * cfg.vocab_size * 256 - table.blocks.numel()
    ids = load_tokenizer(gguf).encode(TEXT)
    with LLM(model=str(gguf)) as llm:
        assert llm.engine.worker.whole_model is not None  # decode steps look rows up in Rust
        blocks = llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert blocks == _greedy(gguf, ids, gguf_dequantize=True)


def _with_tensor(src_path, dst_path, name: str, kind: str, blocks: np.ndarray):
    """A copy of the GGUF file `src_path` with tensor `name` replaced by raw `blocks` of `kind`."""
    return gguf_rewritten(src_path, dst_path, tensors={name: (kind, blocks)})


# K-quant blocks of 256 weights (gguf's writer cannot make them): random bytes (any bytes are a
# block), with each block's fp16 scale fields set to finite values. (bytes per block, byte offsets
# of its fp16 scales)
K_BLOCKS = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
            "Q6_K": (210, (208,))}


def _blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """`rows` rows of `cols` weights in `kind`'s blocks: random K-quant blocks (their scales varying
    from block to block), or gguf's quantization of random weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    if kind not in K_BLOCKS:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, GGMLQuantizationType[kind])
    size, scale_at = K_BLOCKS[kind]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for at in scale_at:
        scales = (rng.uniform(0.001, 0.01, (rows, cols // 256, 1))).astype(np.float16)
        blocks[..., at:at + 2] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def _dequantized(blocks: np.ndarray, kind: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType[kind]))


def _within_f16_rounding(layer: Int4Linear, weight: torch.Tensor) -> bool:
    """Each weight of the 4-bit layer within what rounding its group's scale and offset to f16
    moves it (2^-11 of each, relative) of `weight`."""
    scales, offsets = (t.float().repeat_interleave(layer.group_size, 1).abs() for t in (layer.scales, layer.offsets))
    return bool(((layer.dequantized() - weight).abs() <= (15 * scales + offsets) * 2**-11 * 1.001).all())


def _within_half_a_step(layer: Int8Linear, weight: torch.Tensor) -> bool:
    """Each weight of the int8 layer within half its row's step of `weight` (and f32's rounding)."""
    return bool(((layer.dequantized() - weight).abs() <= layer.scales[:, None] * (0.5 + 1e-5)).all())


# The int8 path's error on _blocks' weights, RMS(served - file) / RMS(file), measured: Q5_0 0.0068,
# Q5_1 0.0070, Q5_K 0.0060, Q6_K 0.0061 (each row's step is its largest weight / 127; Q5_0 and
# Q6_K take it off the CPU).
INT8_RMS_ERROR = 0.01


@pytest.mark.parametrize("kind, layer", [("Q4_K", KQuantLinear), ("Q5_0", KQuantLinear), ("Q5_1", Int8Linear),
                                         ("Q5_K", Int8Linear), ("Q6_K", KQuantLinear), ("Q2_K", torch.nn.Linear),
                                         ("Q3_K", torch.nn.Linear)])
def test_other_block_formats_become_layers_within_a_bound_of_ggufs_arithmetic(tmp_path, kind, layer):
    """Q4_K, Q6_K and Q5_0 on a CPU are the file's blocks as they are (gguf's dequantization of
    them, exactly); Q5_1 / Q5_K on the int8 path within half a row's step of them (and a measured RMS bound);
    Q2_K / Q3_K widened, exactly gguf's; `gguf_dequantize` widens every one of them so."""
    hf_dir = build_model(tmp_path / "wide", "qwen2", hidden_size=256, intermediate_size=512)
    blocks = _blocks(kind, 512, 256)  # ffn_up: 256 inputs -> 512 outputs
    gguf = _with_tensor(gguf_from_hf(hf_dir, tmp_path / "f32.gguf"), tmp_path / f"{kind}.gguf",
                        "blk.0.ffn_up.weight", kind, blocks)
    native = load_model(gguf, load_config(gguf), torch.float32, torch.device("cpu"), 64, gguf_dequantize=False)
    wide = load_model(gguf, load_config(gguf), torch.float32, torch.device("cpu"), 64, gguf_dequantize=True)
    served, file_weight = native.model.layers[0].mlp.up_proj, _dequantized(blocks, kind)
    assert native.checkpoint_quantization == f"gguf-{kind}" and wide.checkpoint_quantization is None
    assert type(served) is layer
    assert torch.equal(wide.model.layers[0].mlp.up_proj.weight, file_weight)
    if layer is torch.nn.Linear:
        assert torch.equal(served.weight, file_weight)
    elif layer is KQuantLinear:
        assert served.kind == kind and np.array_equal(served.parts[0].numpy(), blocks)
        assert torch.equal(served.dequantized(), file_weight)
    elif layer is Int4Linear:
        assert served.group_size == 32 and _within_f16_rounding(served, file_weight)
    else:
        error = served.dequantized() - file_weight
        assert _within_half_a_step(served, file_weight)
        assert float(error.pow(2).mean().sqrt() / file_weight.pow(2).mean().sqrt()) < INT8_RMS_ERROR


def test_k_quant_rows_of_llama_q_and_k_are_unpermuted_whole(tmp_path):
    """A Llama file's q/k rows are in llama.cpp's rotary order: each row's K-quant blocks move back
    whole, so the served layers hold Hugging Face's rows."""
    from pyserve.testing.tiny_gguf import _permute

    hf_dir = build_model(tmp_path / "llama", "llama", hidden_size=256, intermediate_size=512, **LLAMA_ROPE)
    cfg = load_config(hf_dir)
    gguf = gguf_from_hf(hf_dir, tmp_path / "f32.gguf")
    hf_blocks = {"q": _blocks("Q4_K", cfg.num_heads * cfg.head_dim, 256, seed=1),
                 "k": _blocks("Q6_K", cfg.num_kv_heads * cfg.head_dim, 256, seed=2)}
    gguf = _with_tensor(gguf, tmp_path / "q.gguf", "blk.1.attn_q.weight", "Q4_K",
                        _permute(hf_blocks["q"], cfg.num_heads))
    gguf = _with_tensor(gguf, tmp_path / "qk.gguf", "blk.1.attn_k.weight", "Q6_K",
                        _permute(hf_blocks["k"], cfg.num_kv_heads))
    model = load_model(gguf, load_config(gguf), torch.float32, torch.device("cpu"), 64, gguf_dequantize=False)
    attn = model.model.layers[1].self_attn
    assert model.checkpoint_quantization == "gguf-Q4_K+Q6_K"
    for proj, role in ((attn.q_proj, "q"), (attn.k_proj, "k")):
        assert isinstance(proj, KQuantLinear) and np.array_equal(proj.parts[0].numpy(), hf_blocks[role])


def test_k_quant_parts_of_one_type_are_joined_in_the_layer_kernels_view(tmp_path, monkeypatch):
    """A layer's q and k in Q4_K beside its v in Q6_K: the kernels take q and k as one projection
    over both tensors' rows where they are, and v beside it; the tokens are those of the three
    run side by side."""
    import pyserve.model.decoder as decoder

    hf_dir = build_model(tmp_path / "hf", "qwen2", hidden_size=256, intermediate_size=512)
    gguf = gguf_from_hf(hf_dir, tmp_path / "f32.gguf")
    cfg = load_config(gguf)
    rows = {"q": cfg.num_heads * cfg.head_dim, "k": cfg.num_kv_heads * cfg.head_dim, "v": cfg.num_kv_heads * cfg.head_dim}
    kinds = {"q": "Q4_K", "k": "Q4_K", "v": "Q6_K"}
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(cfg.num_layers):
        for i, (role, kind) in enumerate(kinds.items()):
            tensors[f"blk.{layer}.attn_{role}.weight"] = (kind, _blocks(kind, rows[role], 256, seed=3 * layer + i))
            tensors[f"blk.{layer}.attn_{role}.bias"] = ("F32", rng.standard_normal(rows[role]).astype(np.float32))
    gguf = gguf_rewritten(gguf, tmp_path / "qkv.gguf", tensors=tensors)
    ids = load_tokenizer(gguf).encode(TEXT)
    with LLM(model=str(gguf)) as llm:
        qkv = llm.engine.worker.model.model.layers[0].kernel_weights[1]
        assert [(len(blocks), kind) for blocks, kind, _ in qkv] == [(2, "Q4_K"), (1, "Q6_K")]
        joined = llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setattr(decoder, "_kquant_runs_joined", list)
    with LLM(model=str(gguf)) as llm:
        assert len(llm.engine.worker.model.model.layers[0].kernel_weights[1]) == 3
        apart = llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert joined == apart and len(joined) == GREEDY.max_tokens


@pytest.mark.parametrize("kind, block, x_max, error", [("Q4_K", 256, 127, 0.02), ("Q6_K", 256, 127, 0.02),
                                                      ("Q5_0", 32, 127, 0.02), ("Q8_0", 32, 32767, 1e-4)])
def test_a_k_quant_layer_multiplies_x_quantized_per_block_with_the_files_weights(kind, block, x_max, error):
    """KQuantLinear's CPU kernel: x rounded to int8 per super-block of 256 inputs (per block of 32
    for Q5_0; scale max |x| / 127, halves to even), to int16 per block of 32 for Q8_0 (max |x| /
    32767), against gguf's dequantized weights, within f32 rounding; a row the same alone as in a
    batch; what the rounding of x costs against f32 inputs under `error`."""
    n, k = 40, 768
    blocks = _blocks(kind, n, k, seed=3)
    bias = torch.linspace(-1, 1, n)
    layer = KQuantLinear(torch.from_numpy(blocks), kind, bias)
    x = torch.randn(6, k) * torch.linspace(0.1, 4, k)  # inputs of different sizes across blocks
    groups = x.reshape(6, k // block, block)
    scale = groups.abs().amax(-1, keepdim=True) / x_max
    xq = (torch.round(groups / scale).clamp(-x_max, x_max) * scale).reshape(6, k)
    want = xq.double() @ _dequantized(blocks, kind).double().T + bias.double()
    got = layer(x)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4), (got - want).abs().max()
    assert torch.equal(layer(x[2:3]), got[2:3])
    plain = x @ _dequantized(blocks, kind).T + bias
    assert 0 < float((got - plain).norm() / plain.norm()) < error


@pytest.mark.parametrize("kind, layer", [("Q4_K", Int4Linear), ("Q6_K", Int8Linear)])
def test_off_the_cpu_k_quants_convert_to_the_int4_and_int8_layouts(kind, layer):
    """Where the blocks are not served in place (CUDA's Triton kernels), Q4_K repacks into groups of
    32 (its products d * sc, dmin * m rounded to f16) and Q6_K rounds to int8 rows (half a step)."""
    blocks = _blocks(kind, 64, 512, seed=4)
    weight = _dequantized(blocks, kind)
    if kind == "Q4_K":
        served = Int4Linear(*q4_blocks(blocks, kind), 32, None)
        assert _within_f16_rounding(served, weight)
    else:
        served = Int8Linear(*int8_rows(blocks, kind), None)
        assert _within_half_a_step(served, weight)


def test_a_directory_holding_one_gguf_is_served_from_it(tiny, tmp_path):
    folder = tmp_path / "dir"
    folder.mkdir()
    gguf = gguf_from_hf(tiny["qwen2"], folder / "m.gguf")
    assert gguf_path(folder) == gguf
    assert load_config(folder).family == "qwen2"
    gguf_from_hf(tiny["qwen2"], folder / "other.gguf")
    with pytest.raises(WeightsError, match="several GGUF files.*m.gguf, other.gguf"):
        gguf_path(folder)


def test_a_file_is_a_gguf_by_its_name_or_its_magic_and_any_other_is_refused(tiny, tmp_path):
    blob = tmp_path / "sha256-0f3a"  # an Ollama blob: named by its digest
    blob.write_bytes(gguf_from_hf(tiny["qwen2"], tmp_path / "m.gguf").read_bytes())
    assert gguf_path(blob) == blob and load_config(blob).family == "qwen2"
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(WeightsError, match="notes.txt is a file but not a GGUF file"):
        load_config(text)
    with pytest.raises(ValueError, match="speculative_config.model: .*notes.txt is a file but not a GGUF file"):
        SpeculativeConfig.parse({"method": "draft_model", "model": str(text)})


def test_an_unsupported_architecture_is_refused_naming_it(tiny, tmp_path):
    gguf = gguf_from_hf(tiny["llama"], tmp_path / "m.gguf", arch="phi3")
    with pytest.raises(UnsupportedModelError, match="general.architecture 'phi3'"):
        load_config(gguf)


def test_an_unsupported_architecture_is_refused_before_the_rest_of_the_file_is_read(tiny, tmp_path):
    """Files write general.architecture first: a first open refuses it before it parses the
    vocabulary (here cut off after 256 bytes: the refusal names the architecture, not a bad file)."""
    def cut(arch):
        part = tmp_path / f"{arch}-cut.gguf"
        part.write_bytes(gguf_from_hf(tiny["llama"], tmp_path / f"{arch}.gguf", arch=arch).read_bytes()[:256])
        return part

    with pytest.raises(UnsupportedModelError, match="general.architecture 'phi3'"):
        load_config(cut("phi3"))
    with pytest.raises(WeightsError, match="llama-cut.gguf is not a readable GGUF file"):
        load_config(cut("llama"))


def test_an_unsupported_tensor_type_is_refused_naming_it(tiny, tmp_path):
    gguf = gguf_from_hf(tiny["llama"], tmp_path / "m.gguf")
    iq = np.zeros((128, 64 // 32 * 18), np.uint8)  # IQ4_NL: 18 bytes per 32 weights; ffn_up is 64 -> 128
    bad = _with_tensor(gguf, tmp_path / "iq.gguf", "blk.0.ffn_up.weight", "IQ4_NL", iq)
    start = time.perf_counter()
    with pytest.raises(UnsupportedModelError, match="blk.0.ffn_up.weight has type IQ4_NL"):
        LLM(model=str(bad))
    assert time.perf_counter() - start < 1.0


def test_a_file_that_is_not_gguf_is_refused_at_once(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    start = time.perf_counter()
    with pytest.raises(WeightsError, match="broken.gguf is not a readable GGUF file"):
        LLM(model=str(bad))
    assert time.perf_counter() - start < 1.0


class _Fields:
    """The metadata build_tokenizer reads, without a file."""

    def __init__(self, values):
        self.values = values

    def get(self, key, default=None):
        return self.values.get(key, default)


def test_a_sentencepiece_vocabulary_merges_by_score_and_falls_back_to_bytes():
    # SentencePiece merges the adjacent pair whose result scores highest: here ▁h, ll, llo, ▁he,
    # ▁hello in turn ("el" scores too low to be made first).
    pieces = {"\u2581": 0.0, "h": 0.0, "e": 0.0, "l": 0.0, "o": 0.0, "\u2581h": -1.0, "ll": -2.0, "llo": -3.0,
              "\u2581he": -4.0, "el": -5.0, "\u2581hello": -6.0}
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * (3 + 256) + list(pieces.values())
    tok, facts = build_tokenizer(_Fields({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0}))
    enc = tok.encode("hello h\u00e9")
    assert enc.tokens == ["<s>", "\u2581hello", "\u2581h", "<0xC3>", "<0xA9>"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "hello h\u00e9"
    assert (facts["bos_token"], facts["eos_token"]) == ("<s>", "</s>")


def test_an_unknown_pre_tokenizer_is_refused_naming_it():
    with pytest.raises(UnsupportedModelError, match="tokenizer.ggml.pre 'klingon'"):
        build_tokenizer(_Fields({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "klingon",
                                 "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": []}))


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q6_K"])
def test_int8_rows_are_quantize_int8_of_ggufs_widening_bit_for_bit(kind):
    from pyserve.model.gguf.weights import int8_rows

    blocks = _blocks(kind, 37, 512, seed=3)
    q, scales = int8_rows(blocks, kind)
    want_q, want_scales = quantize_int8(_dequantized(blocks, kind))
    assert torch.equal(q, want_q) and torch.equal(scales, want_scales)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_4_bit_rows_repack_to_ggufs_weights(kind):
    """Q4_0 / Q4_1 bit for bit; Q4_K's scale d * sc and offset -dmin * m rounded to f16 (computed
    here from the block's fields as gguf reads them)."""
    from pyserve.model.gguf.weights import q4_blocks

    blocks = _blocks(kind, 19, 512, seed=4)
    packed, scales, offsets = q4_blocks(blocks, kind)
    layer = Int4Linear(packed, scales, offsets, 32, None)
    if kind != "Q4_K":
        assert torch.equal(layer.dequantized(), _dequantized(blocks, kind))
        return
    from gguf.quants import Q4_K

    b = blocks.reshape(-1, 144)
    d, dmin = (b[:, at:at + 2].copy().view(np.float16).astype(np.float32) for at in (0, 2))
    sc, m = Q4_K.get_scale_min(b[:, 4:16])
    assert torch.equal(scales.reshape(-1, 8), torch.from_numpy((d * sc.reshape(-1, 8).astype(np.float32))
                                                               .astype(np.float16)))
    assert torch.equal(offsets.reshape(-1, 8), torch.from_numpy((-(dmin * m.reshape(-1, 8).astype(np.float32)))
                                                                .astype(np.float16)))
    assert _within_f16_rounding(layer, _dequantized(blocks, kind))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q6_K"])
def test_rows_widen_to_ggufs_dequantization_bit_for_bit(kind):
    from pyserve.model.gguf.weights import _dequantize

    blocks = _blocks(kind, 23, 512, seed=5)
    assert torch.equal(torch.from_numpy(_dequantize(blocks, kind, "t")), _dequantized(blocks, kind))


def test_the_block_sizes_held_here_are_the_gguf_packages():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    assert {kind: GGML_QUANT_SIZES[GGMLQuantizationType[kind]] for kind in BLOCK_SIZES} == BLOCK_SIZES
