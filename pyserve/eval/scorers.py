"""Scoring one eval item (items.py says what each scorer checks). Text scorers take the
generated text; `choice` takes each choice's loglikelihood after the prompt, `perplexity` the
reference tokens' logprobs. A score is in [0, 1]; perplexity items carry their negative
loglikelihood and token count instead (the set's perplexity is exp(sum nll / sum tokens))."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

from pyserve.eval.code_sandbox import program_of, run_tests
from pyserve.eval.items import (ChoiceItem, CodeItem, ContainsItem, ExactItem, JsonSchemaItem, LinePrefixItem,
                                NumericItem, PerplexityItem, RegexItem)

NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


@dataclass(slots=True)
class Score:
    value: float | None  # in [0, 1]; None for a perplexity item
    detail: str = ""
    nll: float | None = None  # perplexity items: -sum of the reference tokens' logprobs
    tokens: int = 0


def score_text(item, output: str) -> Score:
    """A generating item's score for the model's `output`."""
    if isinstance(item, ExactItem):
        return Score(float(output.strip() == item.reference.strip()))
    if isinstance(item, ContainsItem):
        return Score(float(item.reference in output))
    if isinstance(item, RegexItem):
        return Score(float(re.search(item.pattern, output) is not None))
    if isinstance(item, LinePrefixItem):
        return _line_prefix(item.reference.strip(), output)
    if isinstance(item, JsonSchemaItem):
        return _json_schema(item, output)
    if isinstance(item, NumericItem):
        match = NUMBER.search(output)
        if match is None:
            return Score(0.0, "no number in the output")
        value = float(match.group())
        allowed = max(item.tolerance, item.relative * abs(item.reference))
        return Score(float(abs(value - item.reference) <= allowed), f"read {value}")
    if isinstance(item, CodeItem):
        program = program_of(output)
        if item.with_prompt:
            program = item.prompt + program
        elif item.preamble is not None:
            program = item.preamble + program
        result = run_tests(program, item.tests, item.timeout_s, item.memory_mb)
        return Score(float(result.passed), result.reason)
    raise TypeError(f"{type(item).__name__} is not scored on generated text")


def _line_prefix(reference: str, output: str) -> Score:
    line = next((x.strip() for x in output.splitlines() if x.strip()), "")
    same = len(os.path.commonprefix([line, reference]))
    return Score(same / len(reference), f"{same} of {len(reference)} characters")


def _json_schema(item: JsonSchemaItem, output: str) -> Score:
    import jsonschema

    try:
        value = json.loads(output)
    except ValueError as e:
        return Score(0.0, f"not JSON: {e}")
    errors = list(jsonschema.validators.validator_for(item.schema_)(item.schema_).iter_errors(value))
    return Score(float(not errors), errors[0].message if errors else "")


def score_choice(item: ChoiceItem, loglikelihoods: list[float]) -> Score:
    """1 when the answer's loglikelihood is the highest (a tie goes to the lowest index)."""
    if len(loglikelihoods) != len(item.choices):
        raise ValueError(f"{len(loglikelihoods)} loglikelihoods for {len(item.choices)} choices")
    best = max(range(len(loglikelihoods)), key=lambda i: (loglikelihoods[i], -i))
    return Score(float(best == item.answer), f"picked {best}")


def score_perplexity(item: PerplexityItem, token_logprobs: list[float]) -> Score:
    if not token_logprobs:
        raise ValueError("the reference has no tokens to score")
    nll = -math.fsum(token_logprobs)
    return Score(None, f"perplexity {math.exp(nll / len(token_logprobs)):.4g}", nll, len(token_logprobs))
