"""/v1/files and /v1/batches through the official openai client against a live server: upload,
create, poll, download (every line answered once, bad lines in the error file with their
custom_id), cancel, expiry, tenants, bounds; and a line-by-line check that interactive requests
go before queued batch lines."""

from __future__ import annotations

import io
import json
import time

import httpx
import openai
import pytest

from pyserve.testing import start_server, stop_server
from pyserve.testing.in_process import serving_models

KEY = "batch-key"
MODEL = "tiny"


def lines(n: int, max_tokens: int = 6, prefix: str = "r", **body) -> list[str]:
    return [json.dumps({"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": MODEL, "messages": [{"role": "user", "content": f"def f{i}(x):"}],
                                 "max_tokens": max_tokens, "temperature": 0, **body}}) for i in range(n)]


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    model = model_dirs["llama"]
    data = tmp_path_factory.mktemp("batch-data")
    proc, base = start_server(model, "--served-model-name", MODEL, "--api-key", KEY, "--embedding-model", "none",
                              "--data-dir", str(data), "--batch-max-file-bytes", "200000", "--max-num-seqs", "2",
                              "--batch-max-in-flight", "8", workdir=model.parent)
    yield base
    stop_server(proc)


def client(server: str, tenant: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0,
                         default_headers={"X-Tenant": tenant} if tenant else None)


def upload(api: openai.OpenAI, text_lines: list[str]):
    return api.files.create(file=("input.jsonl", io.BytesIO("\n".join(text_lines).encode())), purpose="batch")


def wait(api: openai.OpenAI, batch_id: str, until=("completed", "failed", "cancelled", "expired"), timeout=120.0):
    deadline = time.monotonic() + timeout
    while True:
        batch = api.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)


def records(api: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(ln) for ln in api.files.content(file_id).text.splitlines()]


def test_a_batch_answers_every_line_once_and_reports_bad_lines(server):
    api = client(server)
    bad = ["{oops", json.dumps({"custom_id": "nomodel", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "nope", "messages": []}}),
           json.dumps({"custom_id": "neg", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}})]
    f = upload(api, lines(12) + bad)
    assert (f.object, f.purpose, f.filename) == ("file", "batch", "input.jsonl")
    batch = api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"job": "test"})
    assert batch.status == "validating" and batch.metadata == {"job": "test"}
    batch = wait(api, batch.id)
    assert batch.status == "completed" and batch.completed_at and batch.in_progress_at and batch.finalizing_at
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (15, 12, 3)
    out = records(api, batch.output_file_id)
    assert batch.model == MODEL
    assert (batch.usage.input_tokens, batch.usage.output_tokens, batch.usage.total_tokens) == (
        sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in out), 12 * 6,
        sum(r["response"]["body"]["usage"]["total_tokens"] for r in out))
    assert sorted(r["custom_id"] for r in out) == sorted(f"r{i}" for i in range(12))
    assert all(r["response"]["status_code"] == 200 and r["response"]["body"]["object"] == "chat.completion"
               and r["response"]["body"]["usage"]["completion_tokens"] == 6 and r["error"] is None for r in out)
    errors = {r["custom_id"]: r for r in records(api, batch.error_file_id)}
    assert set(errors) == {None, "nomodel", "neg"}
    assert errors["nomodel"]["error"]["code"] == "model_not_found" and errors["nomodel"]["response"] is None
    assert errors["neg"]["response"]["status_code"] == 400 and "max_tokens" in errors["neg"]["error"]["message"]
    direct = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def f3(x):"}],
                                         max_tokens=6, temperature=0)
    assert next(r for r in out if r["custom_id"] == "r3")["response"]["body"]["choices"][0]["message"]["content"] \
        == direct.choices[0].message.content
    assert batch.id in [b.id for b in api.batches.list()]
    assert {f.id, batch.output_file_id, batch.error_file_id} <= {x.id for x in api.files.list()}
    assert api.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        api.files.retrieve(f.id)


def test_cancel_stops_the_job_and_keeps_what_was_answered(server):
    api = client(server)
    # 14,400 tokens two sequences at a time: seconds of work, while the cancel is seen within 0.2 s
    f = upload(api, lines(120, max_tokens=120, ignore_eos=True))
    batch = api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait(api, batch.id, until=("in_progress",))
    with pytest.raises(openai.BadRequestError, match="has not finished"):  # a running job's input stays
        api.files.delete(f.id)
    cancelled = api.batches.cancel(batch.id)
    assert cancelled.status == "cancelling"
    batch = wait(api, batch.id, timeout=30)
    assert batch.status == "cancelled" and batch.cancelled_at
    out = records(api, batch.output_file_id)
    assert len(out) == batch.request_counts.completed < 120
    assert len({r["custom_id"] for r in out}) == len(out)
    with pytest.raises(openai.BadRequestError):
        api.batches.cancel(batch.id)
    assert api.files.delete(f.id).deleted  # the job has ended


def test_a_job_past_its_window_expires_with_its_partial_output(server):
    api = client(server)
    # 96,000 tokens two sequences at a time: this model decodes ~10,000 a second on a fast host
    f = upload(api, lines(800, max_tokens=120, ignore_eos=True, prefix="e"))
    batch = api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="2s")
    batch = wait(api, batch.id, timeout=30)
    assert batch.status == "expired" and batch.expired_at
    assert len(records(api, batch.output_file_id)) == batch.request_counts.completed < 800
    expired = records(api, batch.error_file_id)  # as OpenAI's: every line the window closed on, in the errors
    assert len(expired) == batch.request_counts.failed == 800 - batch.request_counts.completed
    assert {r["error"]["code"] for r in expired} == {"batch_expired"}
    assert {r["custom_id"] for r in expired + records(api, batch.output_file_id)} == {f"e{i}" for i in range(800)}


def test_interactive_requests_go_before_queued_batch_lines(server):
    """Two sequences at a time and eight batch lines in the engine (two running, six waiting): an
    interactive request is served as soon as a sequence frees, before the waiting lines, so the
    two lines running when it came finish meanwhile, and perhaps two more around the edges (lines
    ending between the polls and the request); served in arrival order it would wait for six."""
    api = client(server)
    # Lines far longer than the interactive request's round trip, so that the lines ending
    # around it stay few however fast a step is.
    f = upload(api, lines(24, max_tokens=400, ignore_eos=True, prefix="p"))
    batch = api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    while api.batches.retrieve(batch.id).request_counts.completed < 2:
        time.sleep(0.05)
    before = api.batches.retrieve(batch.id).request_counts.completed
    api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    after = api.batches.retrieve(batch.id).request_counts.completed
    assert after - before <= 4, (before, after)
    api.batches.cancel(batch.id)
    wait(api, batch.id, timeout=30)


def test_tenants_see_only_their_own_files_and_jobs(server):
    mine, theirs = client(server, "alice"), client(server, "bob")
    f = upload(mine, lines(1))
    batch = mine.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: theirs.files.retrieve(f.id), lambda: theirs.files.content(f.id),
                 lambda: theirs.batches.retrieve(batch.id), lambda: theirs.batches.cancel(batch.id),
                 lambda: theirs.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in [x.id for x in theirs.files.list()]
    assert batch.id not in [b.id for b in theirs.batches.list()]
    wait(mine, batch.id)


def test_a_file_with_no_line_to_run_fails_the_job_listing_the_lines(server):
    api = client(server)
    f = upload(api, ['{"custom_id": "a"', json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/completions",
                                                      "body": {"model": MODEL, "prompt": "x"}})])
    batch = wait(api, api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id)
    assert batch.status == "failed" and batch.output_file_id is None
    assert [(e.line, e.code) for e in batch.errors.data] == [(1, "invalid_json"), (2, "invalid_url")]


def test_file_and_batch_lists_page_by_after_limit_and_order(server):
    api = client(server, "paging")
    files = [upload(api, lines(1, prefix=f"p{i}")) for i in range(3)]  # newest last
    newest_first = [f.id for f in reversed(files)]
    page = api.files.list(limit=2)
    assert [f.id for f in page.data] == newest_first[:2] and page.has_more
    rest = api.files.list(limit=2, after=page.data[-1].id)
    assert [f.id for f in rest.data] == newest_first[2:] and not rest.has_more
    assert [f.id for f in api.files.list(order="asc").data] == newest_first[::-1]
    assert [f.id for f in api.files.list()] == newest_first  # the client follows has_more
    for query, param in (("limit=0", "limit"), ("order=up", "order")):
        r = httpx.get(f"{server}/v1/files?{query}", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    r = httpx.get(f"{server}/v1/batches?limit=101", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


def test_bad_requests_name_the_field(server):
    api = client(server)
    f = upload(api, lines(1))
    for kwargs, param in (({"endpoint": "/v1/embeddings"}, "endpoint"), ({"completion_window": "soon"},
                                                                         "completion_window"),
                          ({"completion_window": "99999999999999999999h"}, "completion_window"),
                          ({"completion_window": "0s"}, "completion_window"),
                          ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
                          ({"metadata": {"k": "v" * 513}}, "metadata"),
                          ({"extra_body": {"priority": 1}}, "priority")):
        args = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **kwargs}
        with pytest.raises(openai.BadRequestError) as e:
            api.batches.create(**args)
        assert e.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        api.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError) as e:
        api.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    with pytest.raises(openai.APIStatusError) as e:
        api.files.create(file=("big.jsonl", io.BytesIO(b"x" * 300_000)), purpose="batch")
    assert e.value.status_code == 413
    r = httpx.get(server + "/v1/batches")
    assert r.status_code == 401
    assert api.batches.list().data is not None  # the refused jobs were never stored


async def test_without_a_data_dir_the_routes_say_so(model_dirs):
    async with serving_models({"tiny": {"model": str(model_dirs["llama"])}}) as (_, http):
        for method, path in (("GET", "/v1/batches"), ("POST", "/v1/files"), ("GET", "/v1/files/file-x")):
            r = await http.request(method, path)
            assert (r.status_code, r.json()["error"]["code"]) == (404, "batch_api_off")


def test_batch_lines_read_and_write_their_owners_semantic_cache(model_dirs, tmp_path):
    """A job's lines run as the tenant that created it: the answer a line stores is another line's
    of the same tenant, and that tenant's interactive requests' too, never another tenant's."""
    model = model_dirs["llama"]
    proc, base = start_server(model, "--served-model-name", MODEL, "--api-key", KEY, "--semantic-cache",
                              "--data-dir", str(tmp_path / "data"), workdir=model.parent)
    try:
        def run_job(tenant: str, prefix: str) -> dict:
            api = client(base, tenant)
            job = api.batches.create(input_file_id=upload(api, lines(1, prefix=prefix)).id,
                                     endpoint="/v1/chat/completions", completion_window="24h")
            (record,) = records(api, wait(api, job.id).output_file_id)
            return record["response"]["body"]["usage"]

        assert run_job("acme", "a")["pyserve_cache"] == "miss"
        assert run_job("globex", "g")["pyserve_cache"] == "miss"  # the same line, another tenant: not acme's entry
        assert run_job("acme", "b")["pyserve_cache"] == "hit"
        interactive = httpx.post(base + "/v1/chat/completions", timeout=60, json=json.loads(lines(1)[0])["body"],
                                 headers={"Authorization": f"Bearer {KEY}", "X-Tenant": "acme"})
        assert interactive.headers["x-pyserve-cache"] == "hit"
    finally:
        stop_server(proc)
