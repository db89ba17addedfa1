"""The model's tokenizer (`tokenizer.json` through the `tokenizers` library) and its chat template,
rendered in a sandboxed Jinja environment."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

MAX_REPEAT = 100_000  # items a `*` repetition may make (the sandbox's own cap on `range`)
MAX_POWER_BITS = 4096  # size of an integer `**` result
MAX_RENDERED_CHARS = 4_000_000  # a longer rendered prompt is refused while it is being rendered


def _gpt2_byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, used by every ByteLevel tokenizer): printable Latin-1
    bytes stand for themselves, the other 68 bytes for code points from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in alphabet.values()]
    alphabet.update({chr(256 + i): b for i, b in enumerate(others)})
    return alphabet


_BYTE_OF_CHAR = _gpt2_byte_alphabet()
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class ChatTemplateError(ValueError):
    """The chat template is missing, broken, or tried something the sandbox forbids."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with `*` and `**` bounded too. NOTE: the sandbox caps `range`, but
    `{{ 9 ** (9**9) }}` would run for minutes (Jinja folds it while compiling, uninterruptibly) and
    `'x' * 10**10` would exhaust memory."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left).bit_length() * right > MAX_POWER_BITS:
                raise SecurityError(f"{left} ** {right} is too large for a chat template")
        if operator == "*":
            seq, count = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * count > MAX_REPEAT:
                raise SecurityError(f"repeating {len(seq)} items {count} times exceeds {MAX_REPEAT}")
        return super().call_binop(context, operator, left, right)


@dataclass(slots=True)
class Tokenizer:
    inner: HFTokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_id: int | None
    _compiled_template: tuple[str, Any] | None = field(default=None, repr=False)
    # token_text's memo, one dict per skip_special_tokens value (index 1: True).
    _token_texts: tuple[dict[int, str], dict[int, str]] = field(default_factory=lambda: ({}, {}), repr=False)
    _token_bytes: dict[int, bytes] = field(default_factory=dict, repr=False)  # token_bytes' memo
    _byte_level: bool | None = field(default=None, repr=False)  # tokens spell bytes in GPT-2's alphabet

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model directory {model_dir}")
        inner = HFTokenizer.from_file(str(path))
        cfg: dict[str, Any] = {}
        cfg_path = model_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        template_file = model_dir / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        eos_id = inner.token_to_id(eos) if eos else None
        return cls(inner=inner, chat_template=template, bos_token=bos, eos_token=eos, eos_token_id=eos_id)

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inner.encode(text, add_special_tokens=add_special_tokens).ids

    def single_tokens(self, texts: tuple[str, ...]) -> dict[str, int]:
        """Those of `texts` this vocabulary encodes as one token, with its id."""
        found = {t: self.encode(t, add_special_tokens=False) for t in texts}
        return {t: ids[0] for t, ids in found.items() if len(ids) == 1}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """`decode` of each sequence. One call each: the library's own decode_batch hands the
        sequences to its thread pool, which wakes threads on the cores the model's kernels run on,
        and was slower at every size measured (1-256 short windows: 17 us against 2.4 for 4)."""
        decode = self.inner.decode
        return [decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    def token_text(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """`decode([token_id])`, memoized: a token's text alone never changes."""
        memo = self._token_texts[skip_special_tokens]
        text = memo.get(token_id)
        if text is None:
            text = memo[token_id] = self.inner.decode([token_id], skip_special_tokens=skip_special_tokens)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, also where they are not whole UTF-8 characters (a byte-level
        BPE token, a `<0xNN>` byte-fallback token), as OpenAI's logprobs `bytes` give them; an added
        token's, and any other token's, are its text's."""
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        if self._byte_level is None:
            self._byte_level = "ByteLevel" in json.dumps(json.loads(self.inner.to_str()).get("decoder"))
        piece = self.inner.id_to_token(token_id)
        added = token_id in self.inner.get_added_tokens_decoder()
        if piece is not None and not added and self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            value = bytes(_BYTE_OF_CHAR[c] for c in piece)
        elif piece is not None and not added and _BYTE_TOKEN.fullmatch(piece):
            value = bytes([int(piece[3:5], 16)])
        else:
            value = self.inner.decode([token_id], skip_special_tokens=False).encode()
        self._token_bytes[token_id] = value
        return value

    def id_to_token(self, token_id: int) -> str | None:
        return self.inner.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            template: str | None = None, tools: list[dict[str, Any]] | None = None,
                            continue_final_message: bool = False,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """Renders `messages` (and `tools`, Hugging Face's convention: a list of
        {"type": "function", "function": {...}}) with the model's template, or with `template` (a request's own), in
        a sandbox (no attribute escapes, no mutation, bounded ranges, repetitions and output);
        a template that fails is a ChatTemplateError. NOTE: the sandbox bounds each operation,
        not the number of loop iterations: run untrusted templates under a deadline.
        `continue_final_message`: the text ends right after the last message's (an assistant's),
        for the model to continue it; `template_kwargs`: more variables for the template (as
        Hugging Face's `**kwargs`, e.g. Qwen3's `enable_thinking`)."""
        if continue_final_message:
            check_continuable(messages, add_generation_prompt)
        check_template_kwargs(template_kwargs or {})
        source = self.chat_template if template is None else template
        if not source:
            raise ChatTemplateError("this model has no chat template (tokenizer_config.json chat_template)")
        try:
            compiled_source, compiled = self._compiled_template or (None, None)
            if template is not None or compiled_source != source:
                env = _Sandbox(trim_blocks=True, lstrip_blocks=True)
                env.globals["raise_exception"] = _raise
                env.filters["tojson"] = _tojson
                compiled = env.from_string(source)
                if template is None:  # the model's template is compiled once
                    self._compiled_template = (source, compiled)
            pieces, size = [], 0
            for piece in compiled.generate(**(template_kwargs or {}), messages=messages,
                                           add_generation_prompt=add_generation_prompt, tools=tools,
                                           bos_token=self.bos_token or "", eos_token=self.eos_token or ""):
                size += len(piece)
                if size > MAX_RENDERED_CHARS:
                    raise ChatTemplateError(f"chat template output exceeds {MAX_RENDERED_CHARS} characters")
                pieces.append(piece)
            text = "".join(pieces)
            return _continued(text, messages[-1]["content"]) if continue_final_message else text
        except ChatTemplateError:
            raise
        except SecurityError as e:
            raise ChatTemplateError(f"chat template refused by the sandbox: {e}") from e
        # ArithmeticError: 1/0, a range past MAX_RANGE (OverflowError); LookupError: a missing key
        # in a `%` format; RecursionError: a macro calling itself.
        except (TemplateError, TypeError, ValueError, ArithmeticError, LookupError, RecursionError) as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    template: str | None = None, tools: list[dict[str, Any]] | None = None,
                    continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt a chat becomes: apply_chat_template's text, encoded without special tokens
        (the template writes its own)."""
        text = self.apply_chat_template(messages, add_generation_prompt, template, tools, continue_final_message,
                                        template_kwargs)
        return self.encode(text, add_special_tokens=False)


# The variables a template is rendered with; a request's own template variables may not set them.
TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token")


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    taken = sorted(set(kwargs) & set(TEMPLATE_VARIABLES))
    if taken:
        raise ValueError(f"chat_template_kwargs: {', '.join(taken)} cannot be set here (the request's own fields)")


def check_continuable(messages: list[dict[str, Any]], add_generation_prompt: bool) -> None:
    """Refuses what continue_final_message cannot continue: a ValueError naming the field."""
    if add_generation_prompt:
        raise ValueError("continue_final_message: not with add_generation_prompt (set it to false)")
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or not isinstance(last.get("content"), str) or not last["content"].strip():
        raise ValueError("continue_final_message: the last message must be an assistant's, with text to continue")


def _continued(rendered: str, final: str) -> str:
    """`rendered` cut right after the final message's text (its whitespace kept where the template
    kept it), so that the model continues it instead of starting a new turn."""
    core = final.strip()
    at = rendered.rfind(core)
    if at < 0:
        raise ChatTemplateError("continue_final_message: the chat template does not write the last message's text")
    end = at + len(core)
    tail = final[len(final.rstrip()):]
    return rendered[:end + len(tail)] if rendered.startswith(tail, end) else rendered[:end]


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """`tojson` as transformers' templates have it: plain JSON (Jinja's own escapes <, >, & and ')."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):  # AddedToken serialized as a dict
        return tok.get("content")
    return tok
