"""SmolLM2-135M-Instruct served from llama.cpp's Q4_1 file: greedy tokens against transformers
loading the same file (which dequantizes it), 16 chat prompts x 64 tokens, with pyserve widening
the weights the same way (token for token) and on its native int4 path (top-1 agreement along the
reference's own tokens)."""

from __future__ import annotations

import pytest

from pyserve import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?", "Write a haiku about autumn leaves.", "Explain recursion to a child.",
    "Name the three primary colors.", "How do I reverse a list in Python?", "Give me a tip for sleeping better.",
    "What does a compiler do?", "Summarize the water cycle in two sentences.", "Translate 'good morning' to Spanish.",
    "Why is the sky blue?", "Write a limerick about a cat who codes.", "What is 17 times 23?",
    "Suggest a name for a bakery.", "What are the planets of the solar system?", "Describe a rainbow to someone.",
    "Write a short thank-you note to a teacher.",
]
TOKENS = 64


@pytest.fixture(scope="module")
def reference(smollm2):
    """(prompt ids, transformers' greedy continuation) per prompt: KV-cached greedy decoding of
    the model transformers builds from the GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(smollm2), gguf_dequantize=True, max_model_len=1024)
    tok = llm.get_tokenizer()
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    got = [o.outputs[0].token_ids for o in llm.generate(ids, SamplingParams(temperature=0, max_tokens=TOKENS,
                                                                                 ignore_eos=True), use_tqdm=False)]
    llm.close()
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name, dtype=torch.float32)
    refs = []
    with torch.no_grad():
        for prompt in ids:
            out = hf(torch.tensor([prompt]), use_cache=True)
            tokens = []
            for _ in range(TOKENS):
                tokens.append(int(out.logits[0, -1].argmax()))
                out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            refs.append(tokens)
    return ids, refs, got


def test_dequantized_gguf_gives_transformers_greedy_tokens(reference):
    ids, refs, got = reference
    assert got == refs
    assert sum(len(t) for t in got) == len(PROMPTS) * TOKENS


def test_native_int4_path_agrees_with_the_reference_top1(smollm2, reference):
    """Q4_1 blocks on the int4 path and the Q8_0 head as the file holds it, teacher-forced along the
    reference's tokens: the share of them that are its own top-1 choice."""
    ids, refs, _ = reference
    llm = LLM(model=str(smollm2), max_model_len=1024)
    assert llm.stats()["quantization"] == "gguf-Q4_1+Q8_0"
    outs = llm.generate([p + r for p, r in zip(ids, refs)], SamplingParams(max_tokens=1, prompt_logprobs=1),
                        use_tqdm=False)
    agree = total = 0
    first_divergence = []
    for prompt, ref, out in zip(ids, refs, outs):
        ranks = [out.prompt_logprobs[len(prompt) + j][tok].rank for j, tok in enumerate(ref)]
        agree += sum(r == 1 for r in ranks)
        total += len(ranks)
        first_divergence.append(next((j for j, r in enumerate(ranks) if r != 1), None))
    llm.close()
    print(f"native int4: top-1 agreement {agree / total:.4f}, first divergence per prompt {first_divergence}")
    assert agree / total >= 0.98
