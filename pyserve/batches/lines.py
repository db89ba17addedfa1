"""An input file's lines, checked before a job starts (the server's Batch API and `pyserve batch`
alike): each must be a JSON object with a unique string `custom_id`, `method` POST, one of the
job's urls and a `body` object naming a served model, not streamed. A line is parsed as the
server parses a request body (orjson): one it would refuse over HTTP (nested more than 1024 deep,
an escaped lone surrogate such as "\\ud800") is not valid JSON here either; a body is sent as orjson
writes it, at most MAX_BODY_DEPTH objects and arrays deep. A line that fails gets an error record
(with its custom_id when it has one); the rest run."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

import orjson

MAX_BODY_DEPTH = 254  # objects and arrays, the body counted: the deepest orjson writes (post_json sends with it)


@dataclass(slots=True)
class Line:
    number: int  # 0-based, among the file's non-blank lines: the output's order, the store's key
    custom_id: str
    url: str
    body: dict


@dataclass(slots=True)
class Rejected:
    number: int  # as Line.number
    line: int  # 1-based, in the file as a user counts its lines (blank ones too)
    record: dict  # its error record


def error_record(custom_id, code: str, message: str) -> dict:
    """The output record of a line that never reached the server."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def answered_record(custom_id, status: int, payload: dict) -> dict:
    """The output record of a line the server answered: its status and body; `error` set unless 200."""
    err = None
    if status != 200:
        body_error = payload.get("error") or {}
        err = {"code": body_error.get("code") or body_error.get("type"), "message": body_error.get("message")}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": payload.get("id") if status == 200 else None,
                         "body": payload}, "error": err}


def tokens_used(payload: dict) -> tuple[int, int, int, int]:
    """(input, cached, output, reasoning) tokens of an answer's `usage`; 0 for each it does not give."""
    usage = payload.get("usage") or {}
    return (usage.get("prompt_tokens") or 0, (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            usage.get("completion_tokens") or 0,
            (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)


def check_lines(content: bytes, endpoints: tuple[str, ...], model_served: Callable[[str], bool],
                max_lines: int, default_model: str | None = None) -> tuple[list[Line], list[Rejected]]:
    """(the lines to run, the others with their error records). ValueError when the file as
    a whole cannot be a batch input (not UTF-8, empty, too many lines). `default_model`: the model
    of a body that names none (`pyserve batch`, as vLLM's run_batch; the Batch API has none)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"input_file_id: the file is not UTF-8 ({e})") from None
    # A line ends at "\n" only (a "\r" before it dropped), as OpenAI and vLLM read a file:
    # U+2028, U+2029 and U+0085 are characters inside a line (JSON.stringify writes them raw).
    raw = [(i + 1, ln.removesuffix("\r")) for i, ln in enumerate(text.split("\n")) if ln.strip()]
    if not raw:
        raise ValueError("input_file_id: the file has no lines")
    if len(raw) > max_lines:
        raise ValueError(f"input_file_id: the file has {len(raw)} lines; a batch takes at most {max_lines}")
    good: list[Line] = []
    bad: list[Rejected] = []
    seen: set[str] = set()
    for n, (line, ln) in enumerate(raw):
        try:
            item = orjson.loads(ln)
        except orjson.JSONDecodeError as e:  # e.msg: orjson's "line 1, column c" counts within the line
            bad.append(Rejected(n, line, error_record(None, "invalid_json",
                                                      f"line {line} is not valid JSON: {e.msg} (column {e.colno})")))
            continue
        if default_model is not None and isinstance(item, dict) and isinstance(item.get("body"), dict):
            item["body"].setdefault("model", default_model)
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
        problem = _problem(item, endpoints, model_served, seen)
        if problem is not None:
            bad.append(Rejected(n, line, error_record(custom_id, *problem)))
            continue
        seen.add(custom_id)
        good.append(Line(n, custom_id, item["url"], item["body"]))
    return good, bad


def duplicate(custom_id: str) -> tuple[str, str]:
    """(code, message) of a line whose custom_id an earlier line has."""
    return "duplicate_custom_id", f"custom_id: {custom_id!r} is used by an earlier line"


def _problem(item, endpoints: tuple[str, ...], model_served, seen: set[str]) -> tuple[str, str] | None:
    if not isinstance(item, dict):
        return "invalid_request", "the line must be a JSON object"
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "invalid_request", "custom_id: must be a non-empty string"
    if custom_id in seen:
        return duplicate(custom_id)
    if item.get("method") != "POST":
        return "invalid_method", "method: must be POST"
    if item.get("url") not in endpoints:
        return "invalid_url", f"url: {item.get('url')!r} is not this batch's endpoint ({' or '.join(endpoints)})"
    body = item.get("body")
    if not isinstance(body, dict):
        return "invalid_request", "body: must be a JSON object"
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return "invalid_request", "body.model: required, the name of a served model"
    if not model_served(model):
        return "model_not_found", f"body.model: {model!r} is not served here"
    if body.get("stream"):
        return "invalid_request", "body.stream: batch lines are not streamed"
    return _too_deep(body)


def _too_deep(body: dict) -> tuple[str, str] | None:
    """Depth is the one thing orjson cannot write of what orjson.loads read."""
    if _writable(body):
        return None
    key = next(k for k, v in body.items() if not _writable({k: v}))
    return "invalid_request", (f"body.{key}: nested more than {MAX_BODY_DEPTH} objects and arrays deep (the body "
                               "counted), deeper than a batch line is sent")


def _writable(value) -> bool:
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError:
        return False
    return True
