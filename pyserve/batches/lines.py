"""An input file's lines, checked before a job starts: each must be a JSON object with a unique
string `custom_id`, `method` POST, the job's `url` and a `body` object naming a served model.
A line that fails gets an error record (with its custom_id when it has one); the rest run."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class Line:
    number: int  # 0-based, among the file's non-blank lines
    custom_id: str
    body: dict


def error_record(custom_id, code: str, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def check_lines(content: bytes, endpoint: str, model_served: Callable[[str], bool],
                max_lines: int) -> tuple[list[Line], list[tuple[int, dict]]]:
    """(the lines to run, (line number, error record) for the others). ValueError when the file as
    a whole cannot be a batch input (not UTF-8, empty, too many lines)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"input_file_id: the file is not UTF-8 ({e})") from None
    raw = [ln for ln in text.splitlines() if ln.strip()]
    if not raw:
        raise ValueError("input_file_id: the file has no lines")
    if len(raw) > max_lines:
        raise ValueError(f"input_file_id: the file has {len(raw)} lines; a batch takes at most {max_lines}")
    good: list[Line] = []
    bad: list[tuple[int, dict]] = []
    seen: set[str] = set()
    for n, ln in enumerate(raw):
        try:
            item = json.loads(ln)
        except json.JSONDecodeError as e:
            bad.append((n, error_record(None, "invalid_json", f"line {n + 1} is not valid JSON: {e}")))
            continue
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
        problem = _problem(item, endpoint, model_served, seen)
        if problem is not None:
            bad.append((n, error_record(custom_id, *problem)))
            continue
        seen.add(custom_id)
        good.append(Line(n, custom_id, item["body"]))
    return good, bad


def duplicate(custom_id: str) -> tuple[str, str]:
    """(code, message) of a line whose custom_id an earlier line has."""
    return "duplicate_custom_id", f"custom_id: {custom_id!r} is used by an earlier line"


def _problem(item, endpoint: str, model_served, seen: set[str]) -> tuple[str, str] | None:
    if not isinstance(item, dict):
        return "invalid_request", "the line must be a JSON object"
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "invalid_request", "custom_id: must be a non-empty string"
    if custom_id in seen:
        return duplicate(custom_id)
    if item.get("method") != "POST":
        return "invalid_method", "method: must be POST"
    if item.get("url") != endpoint:
        return "invalid_url", f"url: {item.get('url')!r} is not this batch's endpoint {endpoint!r}"
    body = item.get("body")
    if not isinstance(body, dict):
        return "invalid_request", "body: must be a JSON object"
    model = body.get("model")
    if not isinstance(model, str) or not model_served(model):
        return "model_not_found", f"body.model: {model!r} is not served here"
    if body.get("stream"):
        return "invalid_request", "body.stream: batch lines are not streamed"
    return None
