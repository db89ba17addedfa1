"""The eval set: JSON Lines, one item per line, each scored one way.

Every item has an `id` (unique), a `prompt` (completion text) or `messages` (chat), optional
`max_tokens` and `stop` (sent with the request), `source` (a note, not sent), and a `scorer`
with that scorer's fields:
  exact        reference: the output, stripped, equals it
  contains     reference: the output contains it
  regex        pattern: re.search finds it in the output
  line_prefix  reference (one line): partial credit, the share of the reference the output's first
               line (blank lines and the whitespace around it aside) reproduces before it differs
  json_schema  schema: the output parses as JSON valid under it
  numeric      reference, tolerance (absolute, default 0), relative (default 0): the first number
               in the output is within max(tolerance, relative * |reference|) of reference
  choice       choices, answer (an index): the choice with the highest loglikelihood after the
               prompt is the answer (no generation)
  code         tests (Python asserts), timeout_s, memory_mb, with_prompt (default false), preamble:
               the program (the output's first ``` block, else the output; after the prompt when
               with_prompt, after the preamble when given) passes the tests in the sandbox
               (code_sandbox.py)
  perplexity   reference: its per-token loglikelihood after the prompt (no generation)
A malformed line stops the load with an EvalSetError naming the line and the field.
`load_eval_data` also takes the name of a built-in set: `humaneval` (eval/humaneval.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator


class EvalSetError(ValueError):
    """A malformed eval set: the message names the file's line and the field."""


class _Item(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: Annotated[str, Field(min_length=1)]
    prompt: Annotated[str, Field(min_length=1)] | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    stop: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)] | None = None
    source: str | None = None  # where the item was drawn from (not sent)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self

    @property
    def generates(self) -> bool:
        """Whether the item is scored on generated text (choice and perplexity only score logprobs)."""
        return True


class ExactItem(_Item):
    scorer: Literal["exact"]
    reference: str


class ContainsItem(_Item):
    scorer: Literal["contains"]
    reference: Annotated[str, Field(min_length=1)]


class RegexItem(_Item):
    scorer: Literal["regex"]
    pattern: str

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a valid regular expression: {e}") from e
        return v


class LinePrefixItem(_Item):
    scorer: Literal["line_prefix"]
    reference: Annotated[str, Field(min_length=1)]

    @field_validator("reference")
    @classmethod
    def _one_line(cls, v: str) -> str:
        if "\n" in v.strip() or not v.strip():
            raise ValueError("must be one non-blank line")
        return v


class JsonSchemaItem(_Item):
    scorer: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        import jsonschema

        try:
            jsonschema.validators.validator_for(v).check_schema(v)
        except jsonschema.SchemaError as e:
            raise ValueError(f"not a valid JSON schema: {e.message}") from e
        return v


class NumericItem(_Item):
    scorer: Literal["numeric"]
    reference: float
    tolerance: Annotated[float, Field(ge=0)] = 0.0
    relative: Annotated[float, Field(ge=0)] = 0.0


class ChoiceItem(_Item):
    scorer: Literal["choice"]
    choices: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=2)]
    answer: Annotated[int, Field(ge=0)]

    @model_validator(mode="after")
    def _answer_in_range(self):
        if self.answer >= len(self.choices):
            raise ValueError(f"answer {self.answer} is not an index of the {len(self.choices)} choices")
        if self.messages is not None:
            raise ValueError("a choice item scores a completion prompt: give prompt, not messages")
        return self

    @property
    def generates(self) -> bool:
        return False


class CodeItem(_Item):
    scorer: Literal["code"]
    tests: Annotated[str, Field(min_length=1)]
    timeout_s: Annotated[float, Field(gt=0, le=600)] = 10.0
    memory_mb: Annotated[int, Field(ge=16, le=1 << 16)] = 512
    with_prompt: bool = False  # the program is the prompt (a completion prompt) then the output
    preamble: str | None = None  # code the program starts with (a chat item's function stub and imports)

    @model_validator(mode="after")
    def _one_lead(self):
        if self.with_prompt and (self.prompt is None or self.preamble is not None):
            raise ValueError("with_prompt needs a prompt (completion) and no preamble")
        return self


class PerplexityItem(_Item):
    scorer: Literal["perplexity"]
    reference: Annotated[str, Field(min_length=1)]

    @model_validator(mode="after")
    def _prompt_only(self):
        if self.messages is not None:
            raise ValueError("a perplexity item scores a completion prompt: give prompt, not messages")
        return self

    @property
    def generates(self) -> bool:
        return False


EvalItem = Annotated[Union[ExactItem, ContainsItem, RegexItem, LinePrefixItem, JsonSchemaItem, NumericItem, ChoiceItem,
                           CodeItem, PerplexityItem], Field(discriminator="scorer")]
_ADAPTER = TypeAdapter(EvalItem)
SCORERS = ("exact", "contains", "regex", "line_prefix", "json_schema", "numeric", "choice", "code", "perplexity")


def _field(loc: tuple) -> str:
    """The error's field, without pydantic's union tag (`('exact', 'reference')` -> 'reference')."""
    parts = [str(x) for x in loc]
    if parts and parts[0] in SCORERS:
        parts = parts[1:]
    return ".".join(parts).replace("schema_", "schema")


def parse_item(line: str, where: str) -> EvalItem:
    """One line as an item; `where` (e.g. "eval.jsonl line 3") starts the error message."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise EvalSetError(f"{where}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise EvalSetError(f"{where}: an item must be a JSON object")
    if "scorer" not in data:
        raise EvalSetError(f"{where}: scorer: missing (one of {', '.join(SCORERS)})")
    if data["scorer"] not in SCORERS:
        raise EvalSetError(f"{where}: scorer: {data['scorer']!r} is not one of {', '.join(SCORERS)}")
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = _field(err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        raise EvalSetError(f"{where}: {field}: {message}" if field else f"{where}: {message}") from e


def load_eval_data(spec: str) -> list[EvalItem]:
    """A built-in set by name (`humaneval`), else the JSON Lines file at `spec`."""
    if spec == "humaneval":
        from pyserve.eval.humaneval import humaneval_items

        return humaneval_items()
    return load_eval_set(spec)


def load_eval_set(path: str | Path) -> list[EvalItem]:
    """Every item of the file, checked; blank lines are skipped; ids must be unique."""
    path = Path(path)
    items, seen = [], {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path.name} line {number}"
        item = parse_item(line, where)
        if item.id in seen:
            raise EvalSetError(f"{where}: id: {item.id!r} is already the id of line {seen[item.id]}")
        seen[item.id] = number
        items.append(item)
    if not items:
        raise EvalSetError(f"{path.name}: no items")
    return items
