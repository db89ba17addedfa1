"""How a text completion reads (/v1/completions): one chunk per delta, each choice's text (with
`echo`, its prompt's text first), and logprobs as the completions API's lists, where each
token's `top_logprobs` holds the sampled token besides the top k and `text_offset` counts the
choice's characters."""

from __future__ import annotations

from pyserve.engine.output_processor import StreamDelta
from pyserve.server.logprob_entries import best


class TextBody:
    object = "text_completion"
    chunk_object = "text_completion"
    final_body_of_stream = True

    def __init__(self, tokenizer, num_top: int, prompts: list[list[int]], echo: list[str] | None, echo_only: bool):
        """`echo`: each prompt's text, put before its completions (with their logprobs when
        asked); `echo_only`: max_tokens 0, the one token the engine generated is not returned."""
        self.tokenizer, self.num_top = tokenizer, num_top
        self.prompts, self.echo, self.echo_only = prompts, echo, echo_only
        self._streamed_chars: dict[int, int] = {}  # per choice: its streamed tokens' characters

    def opening(self, num_choices: int) -> list[dict]:
        return []

    def delta_choice(self, idx: int, d: StreamDelta) -> dict:
        lp = None
        if d.logprobs is not None:
            lp = self.logprobs(d.token_ids, d.logprobs, offset=self._streamed_chars.get(idx, 0))
            self._streamed_chars[idx] = self._streamed_chars.get(idx, 0) + sum(map(len, lp["tokens"]))
        return {"index": idx, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason}

    def choice(self, i: int, output, c, idx: int) -> dict:
        if self.echo is not None:
            return self._echoed(i, output, c, idx)
        lp = None if c.logprobs is None else self.logprobs(c.token_ids, c.logprobs)
        return {"index": idx, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def logprobs(self, token_ids: list[int], entries, offset: int = 0) -> dict:
        """`offset`: the characters of the choice's text before these tokens."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, entries):
            text = self.tokenizer.token_text(tid, skip_special_tokens=False)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            sampled = entry[tid]
            token_logprobs.append(sampled.logprob)
            tops.append({e.decoded_token: e.logprob for _, e in best(entry, self.num_top)}
                        | {sampled.decoded_token: sampled.logprob})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _echoed(self, i: int, output, c, idx: int) -> dict:
        """A choice with prompt i before it: text, and logprobs (the prompt's first token has
        none) when asked."""
        tokens = [] if self.echo_only else c.token_ids
        text = self.echo[i] + ("" if self.echo_only else c.text)
        lp = None
        if output.prompt_logprobs is not None:
            prompt = self.prompts[i]
            first = self.tokenizer.decode(prompt[:1], skip_special_tokens=False)
            head = self.logprobs(prompt[1:], output.prompt_logprobs[1:], offset=len(first))
            lp = {"tokens": [first, *head["tokens"]], "token_logprobs": [None, *head["token_logprobs"]],
                  "top_logprobs": [None, *head["top_logprobs"]], "text_offset": [0, *head["text_offset"]]}
            if tokens:
                tail = self.logprobs(tokens, c.logprobs, offset=sum(len(t) for t in lp["tokens"]))
                lp = {k: lp[k] + tail[k] for k in lp}
        finish = "length" if self.echo_only else c.finish_reason
        return {"index": idx, "text": text, "logprobs": lp, "finish_reason": finish,
                "stop_reason": None if self.echo_only else c.stop_reason}
