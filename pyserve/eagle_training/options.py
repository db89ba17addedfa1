"""`pyserve train-eagle`'s options (its flags are derived from them; no torch here, so the CLI
builds its parser without loading it)."""

from __future__ import annotations

from dataclasses import dataclass

from pyserve.options import option


@dataclass(slots=True)
class TrainOptions:
    prompts: str | None = option(None, "a .jsonl file of {\"messages\"} or {\"prompt\"} lines, or a text file of "
                                 "prompts separated by blank lines (none: the built-in mix)", metavar="FILE")
    num_prompts: int = option(400, "prompts of the built-in mix")
    text: bool = option(False, "prompts are raw text to continue, not chat requests (the default where the "
                        "tokenizer has no chat template)")
    samples: int = option(1, "sampled answers per prompt, besides the greedy one")
    temperature: float = option(0.7, "of the sampled answers")
    max_tokens: int = option(128, "tokens per answer")
    max_len: int = option(512, "tokens per training sequence")
    held_out: float = option(0.1, "share of the prompts held out for the acceptance figure")
    draft_vocab_size: int = option(8192, "the head's vocabulary: the tokens the target says most in the data")
    steps: int = option(2000, "optimizer steps")
    batch: int = option(4, "sequences per step")
    lr: float = option(1e-3, "peak learning rate (warm-up, then cosine decay)")
    ttt_steps: int = option(3, "draft steps unrolled in training (the training-time test)")
    seed: int = option(0, "of the prompts, the sampled answers and the initialization")
    checkpoint_every: int = option(200, "steps between checkpoints (DIR/checkpoint.pt)")
    device: str = option("cpu", "cpu or cuda")
    group_size: int = 32  # the loader's quantization group (unused: the target is not quantized)
