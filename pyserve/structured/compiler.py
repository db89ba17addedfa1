"""Compiles StructuredOutputsParams into llguidance matchers for the model's vocabulary, with a
bounded cache of compiled grammars (each request gets a copy of the cached matcher).

llguidance (Microsoft's grammar engine, Rust with a Python binding) does the work: JSON schema,
regex, Lark and GBNF to one token-level grammar, masks in tens of microseconds a token. Its
parser limits bound the compile and every mask's work, so a hostile grammar fails with an error
instead of burning a thread. It is imported on first use (0.1 s), not at the server's start.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyserve.structured.json_rules import JsonVocab
from pyserve.structured.params import GrammarError, StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

CACHE_SIZE = 256  # compiled grammars kept (a matcher of a large schema holds a few MB at most)
COMPILE_THREADS = 2  # compiles run here, never on the event loop's shared pool
# JSON as OpenAI writes it: no free whitespace (which a small model can fill forever), ", " and ": ".
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _limits() -> llguidance.LLParserLimits:
    import llguidance

    return llguidance.LLParserLimits(max_grammar_size=500_000, initial_lexer_fuel=1_000_000,
                                     step_lexer_fuel=200_000, max_lexer_states=250_000)


@dataclass(slots=True, frozen=True)
class Grammar:
    """A compiled constraint: `matcher()` gives a fresh matcher at the start of the output.
    `json_vocab`: set where the output is JSON or holds some (a grammar's `%json`), whose rules
    (json_rules.py) the masks then hold too; `text_around`: the JSON sits in text."""

    key: tuple[str, str]
    _pristine: llguidance.LLMatcher
    json_vocab: JsonVocab | None = None
    text_around: bool = False

    def matcher(self) -> llguidance.LLMatcher:
        return self._pristine.deep_copy()


class GrammarCompiler:
    """One per engine: the vocabulary (an llguidance tokenizer, built on first use), the cache,
    and the threads compiles run on: a pool of their own, so that a flood of slow compiles
    delays other compiles only, never the embeddings, cache lookups or adapter loads that run
    on asyncio's default pool."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: list[int]):
        """`tokenizer_json`: gives the model's tokenizer.json text (called on first use)."""
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._json_vocab: JsonVocab | None = None
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="pyserve-compile")

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                                             eos_token=self._eos or None)
                except Exception as e:
                    raise GrammarError(f"structured outputs are not available for this model's tokenizer: {e}") from e
            return self._tokenizer

    @property
    def json_vocab(self) -> JsonVocab:
        tokenizer = self.tokenizer
        with self._lock:
            if self._json_vocab is None:
                self._json_vocab = JsonVocab([tokenizer.decode_bytes([i]) for i in range(self.vocab_size)])
            return self._json_vocab

    def prepare(self) -> None:
        """Builds what every compile needs once (a second or two on a 150k vocabulary)."""
        _ = self.json_vocab  # builds the tokenizer too

    def submit(self, spec: StructuredOutputsParams) -> Future[Grammar]:
        """`compile(spec)` on the compile threads. A submitted compile not yet started can be
        cancelled; a started one ends within llguidance's limits."""
        return self._pool.submit(self.compile, spec)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def cached(self, spec: StructuredOutputsParams) -> Grammar | None:
        with self._lock:
            grammar = self._cache.get(spec.key())
            if grammar is not None:
                self._cache.move_to_end(grammar.key)
            return grammar

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """The compiled grammar of `spec` (from the cache when it is there); a GrammarError says
        why a constraint cannot be compiled. Releases the GIL while llguidance compiles."""
        grammar = self.cached(spec)
        if grammar is not None:
            return grammar
        import llguidance

        text = _grammar_text(spec)
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=_limits())
        if matcher.is_error():
            raise GrammarError(_what_is_wrong(matcher.get_error()))
        text_around = spec.grammar is not None and "%json" in spec.grammar
        has_json = spec.json is not None or spec.json_object or text_around
        grammar = Grammar(spec.key(), matcher, self.json_vocab if has_json else None, text_around)
        with self._lock:
            self._cache[grammar.key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar


def _grammar_text(spec: StructuredOutputsParams) -> str:
    import llguidance

    try:
        if spec.json is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
        if spec.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.regex is not None:
            return llguidance.grammar_from("regex", ascii_classes(spec.regex))
        if spec.choice is not None:
            return llguidance.grammar_from("choice", list(spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as e:
        raise GrammarError(_what_is_wrong(str(e))) from e


_ASCII = {"d": ("[0-9]", "0-9"), "w": ("[0-9A-Za-z_]", "0-9A-Za-z_"), "D": ("[^0-9]", None),
          "W": ("[^0-9A-Za-z_]", None)}


def ascii_classes(regex: str) -> str:
    """`regex` with `\\d`, `\\w` (and outside brackets `\\D`, `\\W`) as ASCII classes, as JSON
    Schema's patterns (ECMAScript) and vLLM read them: llguidance's regexes read them as Unicode
    classes, which let `\\d` match any script's digits."""
    out, depth, i = [], 0, 0  # depth: the brackets open around i
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            outside, inside = _ASCII.get(regex[i + 1], (None, None))
            replacement = inside if depth else outside
            out.append(replacement if replacement is not None else regex[i : i + 2])
            i += 2
            continue
        if c == "[":
            depth += 1
            out.append(c)
            i += 1
            for literal in ("^", "]"):  # a class's leading ^, then a ] right after its start, are its own
                if i < len(regex) and regex[i] == literal:
                    out.append(literal)
                    i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


def _what_is_wrong(message: str) -> str:
    """What llguidance says is wrong, without the rendering of the grammar (numbered source
    lines, <state> / <grammar> dumps) that follows it."""
    lines = []
    message = _POSITION.sub("", message.strip())  # a place in the grammar text, which the client never wrote
    for line in message.splitlines():
        if _SOURCE_LINE.match(line) or line.startswith("<"):
            break
        if line.strip():
            lines.append(line.strip())
    text = " ".join(lines)[:500] or "invalid grammar"
    if "coerce_one_of" in text:  # llguidance's advice names an option of its own, not of this API
        return "a oneOf whose branches may both match is not supported here (anyOf accepts either)"
    return text


_SOURCE_LINE = re.compile(r"^\s*\d+ \|")
_POSITION = re.compile(r"^at \d+\(\d+\): ")
