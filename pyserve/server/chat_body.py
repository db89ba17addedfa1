"""How a chat completion reads (/v1/chat/completions): the role chunk that opens each choice's
stream, its deltas (with tools, the choice's text read for calls), each choice's final message,
and logprobs as `content` (each token's bytes as it stands for them, a piece of a character
included)."""

from __future__ import annotations

from pyserve.engine.output_processor import StreamDelta
from pyserve.server.logprob_entries import best
from pyserve.server.tool_calls import ChoiceCalls, ToolPlan


class ChatBody:
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, tokenizer, num_top: int, tools: ToolPlan | None):
        self.tokenizer, self.num_top = tokenizer, num_top
        self.tools = tools if tools is not None and tools.format is not None else None  # calls to read out
        self._calls: dict[int, ChoiceCalls] = {}  # per choice, when calls are read out

    @property
    def final_body_of_stream(self) -> bool:
        """Whether a streamed request's final body is what it streamed (streamed calls' is not kept)."""
        return self.tools is None

    def opening(self, num_choices: int) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": "", "refusal": None}, "logprobs": None,
                 "finish_reason": None} for i in range(num_choices)]

    def delta_choice(self, idx: int, d: StreamDelta) -> dict | None:
        """The chunk's choice for a delta; None while text is held back (it may start a tool call)."""
        lp = None if d.logprobs is None else self.logprobs(d.token_ids, d.logprobs)
        if self.tools is not None:
            calls = self._choice_calls(idx)
            delta, has_calls = calls.delta(d.text, final=d.finish_reason is not None)
            finish = calls.finish_reason(d.finish_reason, has_calls)
            if delta == {} and not finish and lp is None:
                return None
            return {"index": idx, "delta": delta, "logprobs": lp, "finish_reason": finish, "stop_reason": d.stop_reason}
        delta = {"content": d.text} if d.text or not d.finish_reason else {}
        return {"index": idx, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason}

    def choice(self, i: int, output, c, idx: int) -> dict:
        message, finish = {"role": "assistant", "content": c.text}, c.finish_reason
        if self.tools is not None:
            calls = self._choice_calls(idx)
            message = calls.message(c.text)
            finish = calls.finish_reason(finish, "tool_calls" in message or "function_call" in message)
        lp = None if c.logprobs is None else self.logprobs(c.token_ids, c.logprobs)
        # OpenAI's message always has a refusal; this server never refuses
        return {"index": idx, "message": message | {"refusal": None}, "logprobs": lp, "finish_reason": finish,
                "stop_reason": c.stop_reason}

    def logprobs(self, token_ids: list[int], entries) -> dict:
        tokenizer = self.tokenizer
        content = []
        for tid, entry in zip(token_ids, entries):
            top = [{"token": e.decoded_token, "logprob": e.logprob, "bytes": list(tokenizer.token_bytes(t))}
                   for t, e in best(entry, self.num_top)]
            content.append({"token": tokenizer.token_text(tid, skip_special_tokens=False), "logprob": entry[tid].logprob,
                            "bytes": list(tokenizer.token_bytes(tid)), "top_logprobs": top})
        return {"content": content}

    def _choice_calls(self, idx: int) -> ChoiceCalls:
        calls = self._calls.get(idx)
        if calls is None:
            t = self.tools
            calls = self._calls[idx] = ChoiceCalls(t.parser(), t.legacy, t.named, t.forced, t.fallback)
        return calls
