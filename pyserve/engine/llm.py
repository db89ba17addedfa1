"""The offline API (vLLM-style): `LLM(model=...).generate(prompts, sampling_params)`.

LLM owns a private event loop; the same actors as the server run on it while a call is in flight,
in the caller's thread, or in a helper thread while the caller waits where the caller's thread
runs an event loop of its own (a notebook, an async program).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import sys
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from pyserve.default_model import resolve_model
from pyserve.engine.async_engine import AsyncEngine
from pyserve.config import EngineConfig
from pyserve.engine.outputs import RequestOutput
from pyserve.step.sampling_params import SamplingParams
from pyserve.engine.vllm_args import engine_keywords
from pyserve.lora.request import LoRARequest
from pyserve.prompt_budget import fit_chat

Prompt = str | Sequence[int]

# LLMs not closed yet. At exit they are closed before the interpreter tears its modules down: a
# loop closed during teardown would see its actors fail on half-unloaded modules.
_open: weakref.WeakSet[LLM] = weakref.WeakSet()


@atexit.register
def _close_open_llms() -> None:
    for llm in list(_open):
        llm.close()


class LLM:
    def __init__(self, model: str | None = None, **config: Any):
        """`model`: a Hugging Face model directory (default: the embedded model); `config`: any
        field of EngineConfig (device, dtype, max_num_seqs, enable_lora, speculative_config, ...),
        with the same defaults as `pyserve serve`'s flags, or vLLM's keyword for it
        (pyserve.engine.vllm_args: one that pyserve does not serve is refused, saying why)."""
        if "watchdog_timeout" in config:
            raise TypeError("watchdog_timeout: the offline LLM runs its forwards on its own loop; nothing could watch them")
        fields = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name not in ("model", "watchdog_timeout"))
        config = EngineConfig(model=resolve_model(model), watchdog_timeout=None, **engine_keywords(config, fields))
        self.engine = AsyncEngine(config, own_thread=False)  # first: a model refused here leaves no loop to close
        self._loop = asyncio.new_event_loop()
        self._run(self.engine.start())
        _open.add(self)
        self._next_request = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's name for `tokenizer`)."""
        return self.engine.tokenizer

    def _run(self, coro):
        """`coro` run to completion on the LLM's loop."""
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("this LLM is closed")
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: no loop runs in this thread
            return self._loop.run_until_complete(coro)
        with ThreadPoolExecutor(1, thread_name_prefix="pyserve-llm") as helper:
            return helper.submit(self._loop.run_until_complete, coro).result()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order. A prompt is text,
        token ids (a list, a tuple or a numpy array), or vLLM's dict form ({"prompt": text} or
        {"prompt_token_ids": ids}). A prompt that can never be served raises ValueError naming
        the field; the prompts queued before it are aborted."""
        prompts = [_prompt(p) for p in ([prompts] if _is_one_prompt(prompts) else prompts)]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params)} for {len(prompts)} prompts (pass one, or one per prompt)"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts (pass one, or one per prompt)")
        return self._run(self._generate(prompts, params, loras, use_tqdm))

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tools: list[dict[str, Any]] | None = None,
        max_prompt_tokens: int | None = None,
        prompt_policy: str = "turns",
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template, then generates. `tools`
        (OpenAI's / Hugging Face's {"type": "function", "function": {...}} entries) go to the
        template, as in vLLM; reading calls out of the text is the caller's (pyserve.tools).
        `max_prompt_tokens`: each conversation is fitted to this budget by `prompt_policy`
        (pyserve.prompt_budget: older turns dropped whole); an output's prompt_token_ids are
        the prompt it was given. `continue_final_message` (with add_generation_prompt False):
        each conversation's last message, an assistant's, is continued; `chat_template_kwargs`:
        more variables for the template (vLLM's keywords)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.tokenizer

        def prompt_of(conv: list[dict[str, Any]]) -> list[int]:
            return tok.chat_prompt(conv, add_generation_prompt, tools=tools, continue_final_message=continue_final_message,
                                   template_kwargs=chat_template_kwargs)

        if max_prompt_tokens is None:
            prompts = [prompt_of(conv) for conv in conversations]
        else:
            count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
            prompts = [fit_chat(conv, max_prompt_tokens, prompt_policy, prompt_of, count).token_ids
                       for conv in conversations]
        return self.generate(prompts, sampling_params, lora_request=lora_request, use_tqdm=use_tqdm)

    def stats(self) -> dict[str, float | int]:
        return self.engine.stats()

    def close(self) -> None:
        if not self._loop.is_closed():
            self._run(self.engine.stop())
            self._loop.close()

    def __del__(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None and not loop.is_closed() and not loop.is_running():
            self.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _generate(self, prompts: list[Prompt], params: list[SamplingParams], loras: list, use_tqdm: bool):
        adds = []
        for prompt, p, lora in zip(prompts, params, loras):
            if isinstance(prompt, str):
                text, ids = prompt, self.tokenizer.encode(prompt)
            else:
                text, ids = None, [int(t) for t in prompt]
            request_id = str(self._next_request)
            self._next_request += 1
            adds.append(self.engine.add_request(request_id, ids, p, prompt=text, lora_request=lora, streaming=False))
        # All adds reach the EngineCore's inbox together, so they are admitted in one step.
        results = await asyncio.gather(*adds, return_exceptions=True)
        error = next((r for r in results if isinstance(r, BaseException)), None)
        streams = [r for r in results if not isinstance(r, BaseException)]
        if error is not None:
            for stream in streams:  # nobody would collect them
                await self.engine.abort(stream.output.request_id)
            await self.engine.wait_idle()
            raise error
        progress = _Progress(len(streams), enabled=use_tqdm)
        for stream in streams:
            await stream.done.wait()
            if stream.error is not None:
                raise stream.error
            progress.advance()
        progress.close()
        await self.engine.wait_idle()  # so that stats() after the call counts no leftover sequence
        return [s.output for s in streams]


def _is_one_prompt(prompts) -> bool:
    if isinstance(prompts, (str, dict)):
        return True
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    return bool(prompts) and isinstance(prompts[0], (int, np.integer))


def _prompt(prompt) -> Prompt:
    """Text or a list of token ids, from any prompt form `generate` takes."""
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown:
            raise ValueError(f"prompts: {sorted(unknown)[0]!r} is not served here (a dict prompt takes 'prompt' "
                             "or 'prompt_token_ids')")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("prompts: a dict prompt takes one of 'prompt' and 'prompt_token_ids'")
        prompt = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if not isinstance(prompt, Sequence) or not all(isinstance(t, (int, np.integer)) for t in prompt):
        raise ValueError(f"prompts: a prompt is text or token ids, got {type(prompt).__name__}")
    return list(prompt)


class _Progress:
    """A one-line progress bar on stderr for long runs."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.enabled = enabled and total > 1

    def advance(self) -> None:
        self.done += 1
        if self.enabled:
            rate = self.done / max(time.perf_counter() - self.start, 1e-9)
            width = 30
            filled = width * self.done // self.total
            bar = "#" * filled + "-" * (width - filled)
            print(f"\rProcessed prompts [{bar}] {self.done}/{self.total} ({rate:.2f} it/s)",
                  end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)
