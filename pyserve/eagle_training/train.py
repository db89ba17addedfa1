"""`pyserve train-eagle MODEL --out DIR`: an EAGLE-3 head for MODEL, trained on the target's own
answers (data.py) with the training-time test (ttt.py), on the CPU or CUDA.

The head starts as the target's own top layer would read: `fc` passes the highest of its three
layers' features through, the layer adds nothing (o_proj and down_proj zero) and `lm_head` holds
the target's head rows of the draft vocabulary (the tokens the target says most often in the
data). Checkpoints (`DIR/checkpoint.pt`: the head, the optimizer, the step) are written every
`checkpoint_every` steps and at the end; a run finds its checkpoint and goes on from it. The
recorded data is kept too (`DIR/data.pt`), so a resumed run does not generate it again. The
head is saved in the EAGLE-3 layout (`config.json`, `model.safetensors`) with its held-out
acceptance (`DIR/training.json`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
import random
import time
from pathlib import Path

import torch

from pyserve.eagle_training import data, prompts
from pyserve.eagle_training.options import TrainOptions
from pyserve.eagle_training.ttt import accepted_lengths, sequence_loss
from pyserve.model.checkpoint import load_tokenizer
from pyserve.speculative.eagle_config import HeadConfig
from pyserve.speculative.eagle_head import EagleHead


def train_eagle(model: str, out: str | Path, options: TrainOptions, log=print) -> dict:
    """Trains (or resumes) a head for `model` into `out`; returns the training report."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(options.seed)
    device = torch.device(options.device)
    target = data.Recorder(model, options.max_len, options.group_size)
    aux = target.aux_layer_ids
    train_set, held_set = _dataset(model, out, target, options, log)
    head, config = _new_head(target, aux, train_set, options)
    head.to(device)
    trainable = list(head.parameters())
    optimizer = torch.optim.AdamW(trainable, lr=options.lr, weight_decay=0.0)
    step = _resume(out, head, optimizer)
    embed = target.embedding()
    t2d = _target_to_draft(head, target.config.vocab_size)
    rng = random.Random(options.seed + step)
    start = time.perf_counter()
    bar = _progress(options.steps, step)
    while step < options.steps:
        lr = options.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / options.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        right = [[0, 0] for _ in range(options.ttt_steps)]
        loss_sum = 0.0
        for seq in rng.sample(train_set, min(options.batch, len(train_set))):
            loss, counts = sequence_loss(head, *_inputs(embed, seq, t2d, device), options.ttt_steps)
            (loss / options.batch).backward()
            loss_sum += float(loss.detach())
            for r, (n, k) in zip(right, counts):
                r[0] += n
                r[1] += k
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_sum / options.batch:.3f}", acc0=f"{right[0][1] / max(right[0][0], 1):.2f}")
        if step % options.checkpoint_every == 0 or step == options.steps:
            torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       out / "checkpoint.pt")
    bar.close()
    report = {"options": asdict(options), "steps": step, "seconds_this_run": round(time.perf_counter() - start, 1),
              "train_sequences": len(train_set), "held_out_sequences": len(held_set),
              "aux_layer_ids": list(aux), "draft_vocab_size": config.draft_vocab_size,
              **held_out_acceptance(head, embed, held_set, t2d, options.ttt_steps, device)}
    save_head(head, config, out)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    log(json.dumps(report))
    return report


def held_out_acceptance(head: EagleHead, embed, held_set: list[data.Sequence], t2d: torch.Tensor, steps: int,
                        device: torch.device) -> dict:
    """The greedy acceptance on held-out answers (starts from the pair of the prompt's last token
    on: where a server drafts): mean drafts kept per start at depth `steps`, and the chance guess j
    is kept given the ones before it were."""
    head.eval()
    per_sequence = [accepted_lengths(head, *_inputs(embed, seq, t2d, device), steps)[max(seq.prompt_len - 1, 0):]
                    for seq in held_set]
    lengths = torch.cat(per_sequence) if per_sequence else torch.zeros(0, dtype=torch.int64)
    head.train()
    reached = [int((lengths >= j).sum()) for j in range(steps + 1)]
    return {"held_out_mean_accepted": round(float(lengths.float().mean()), 3) if len(lengths) else 0.0,
            "held_out_acceptance_by_position": [round(reached[j + 1] / reached[j], 3) if reached[j] else 0.0
                                                for j in range(steps)]}


def save_head(head: EagleHead, config: HeadConfig, out: Path) -> None:
    """`config.json` and `model.safetensors` as the EAGLE-3 authors lay them out (`d2t` the
    offset of each draft id's target token, `t2d` the target tokens it covers)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    t2d = torch.zeros(config.layer.vocab_size, dtype=torch.bool)  # which target tokens the head can say
    t2d[head.target_ids().cpu()] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")


def _inputs(embed, seq: data.Sequence, t2d: torch.Tensor, device: torch.device):
    """(embeddings of each pair's token, features, draft-id labels) of a sequence's pairs."""
    with torch.no_grad():
        embeds = embed(seq.tokens[1:].long()).float()
    labels = t2d[seq.labels[1:].long()]
    return embeds.to(device), seq.features[:-1].float().to(device), labels.to(device)


def _dataset(model: str, out: Path, target: data.Recorder, options: TrainOptions, log):
    """(train, held-out) sequences, recorded once into DIR/data.pt."""
    cached = out / "data.pt"
    if cached.is_file():
        saved = torch.load(cached)
        return [data.Sequence(*s) for s in saved["train"]], [data.Sequence(*s) for s in saved["held"]]
    tokenizer = load_tokenizer(model)
    chat = not options.text and tokenizer.chat_template is not None
    items = prompts.file_prompts(options.prompts) if options.prompts else \
        prompts.builtin_prompts(chat, options.num_prompts, options.seed)
    held_count = max(1, int(len(items) * options.held_out))
    log(f"generating answers to {len(items)} prompts ({held_count} held out)")
    seqs = data.generate(model, items, chat=chat, max_tokens=options.max_tokens, samples=options.samples,
                         temperature=options.temperature, seed=options.seed, max_len=options.max_len)
    per_prompt = 1 + options.samples
    log(f"recording the target's features over {len(seqs)} sequences")
    cut = held_count * per_prompt  # a prompt's answers all go to one side
    from tqdm import tqdm

    with tqdm(total=len(seqs), desc="recording", unit="seq") as bar:
        recorded = [[target.record(s, n) for s, n in _advancing(part, bar) if len(s) > options.ttt_steps + 2]
                    for part in (seqs[:cut], seqs[cut:])]
    held, train = recorded
    torch.save({"train": [(s.features, s.tokens, s.labels, s.prompt_len) for s in train],
                "held": [(s.features, s.tokens, s.labels, s.prompt_len) for s in held]}, cached)
    return train, held


def _advancing(items: list, bar):
    """`items`, the bar advanced by one for each."""
    for item in items:
        yield item
        bar.update(1)


def _new_head(target: data.Recorder, aux: tuple[int, int, int], train_set, options: TrainOptions):
    cfg = target.config
    counts = torch.bincount(torch.cat([s.labels.long() for s in train_set]), minlength=cfg.vocab_size)
    size = min(options.draft_vocab_size, cfg.vocab_size)
    vocab = counts.argsort(descending=True)[:size].sort().values
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": cfg.hidden_size,
           "intermediate_size": cfg.intermediate_size,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
           "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope.theta,
           "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
           "draft_vocab_size": size, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux)}}
    config = HeadConfig.from_raw(raw, cfg)
    head = EagleHead(config, torch.float32, options.max_len + options.ttt_steps)
    h = cfg.hidden_size
    with torch.no_grad():
        for p in head.midlayer.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * h :] = torch.eye(h)
        head.lm_head.weight.copy_(target.head_rows(vocab))
        head.d2t.copy_(vocab - torch.arange(size))
        head.norm.weight.copy_(target.model.model.norm.weight)
    return head, config


def _target_to_draft(head: EagleHead, vocab: int) -> torch.Tensor:
    """int64 [vocab]: each target token's draft id, -100 outside the draft vocabulary."""
    t2d = torch.full((vocab,), -100, dtype=torch.int64)
    t2d[head.target_ids()] = torch.arange(len(head.d2t))
    return t2d


def _resume(out: Path, head: EagleHead, optimizer) -> int:
    path = out / "checkpoint.pt"
    if not path.is_file():
        return 0
    saved = torch.load(path)
    head.load_state_dict(saved["head"])
    optimizer.load_state_dict(saved["optimizer"])
    return int(saved["step"])


def _progress(total: int, done: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc="train-eagle", unit="step")
