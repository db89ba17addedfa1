import json

import pytest

from pyserve.batches.lines import check_lines

URL = "/v1/chat/completions"


def line(custom_id="a", url=URL, method="POST", body=None) -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url,
                       "body": {"model": "m", "messages": []} if body is None else body})


def test_each_bad_line_is_reported_with_its_custom_id_and_the_rest_run():
    content = "\n".join([
        line("ok1"), "{not json", line("ok1"), line("u", url="/v1/embeddings"), line("g", method="GET"),
        line("nm", body={"model": "nope"}), line("s", body={"model": "m", "stream": True}), json.dumps([1]),
        line(""), "", line("ok2"), line("nomodel", body={"messages": []}),
    ]).encode()
    good, bad = check_lines(content, (URL,), lambda m: m == "m", max_lines=100)
    assert [(g.number, g.custom_id) for g in good] == [(0, "ok1"), (9, "ok2")]
    assert [(r.number, r.line, r.record["custom_id"], r.record["error"]["code"]) for r in bad] == [
        (1, 2, None, "invalid_json"), (2, 3, "ok1", "duplicate_custom_id"), (3, 4, "u", "invalid_url"),
        (4, 5, "g", "invalid_method"), (5, 6, "nm", "model_not_found"), (6, 7, "s", "invalid_request"),
        (7, 8, None, "invalid_request"), (8, 9, "", "invalid_request"), (10, 12, "nomodel", "invalid_request")]
    assert all(r.record["response"] is None and r.record["id"].startswith("batch_req_") for r in bad)
    assert bad[-1].record["error"]["message"] == "body.model: required, the name of a served model"


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe", "not UTF-8"), (b"\n \n", "no lines"), (("\n".join([line(str(i)) for i in range(4)])).encode(),
                                                          "4 lines; a batch takes at most 3")])
def test_a_file_that_cannot_be_an_input_is_refused_naming_it(content, message):
    with pytest.raises(ValueError, match=message):
        check_lines(content, (URL,), lambda m: True, max_lines=3)


def test_a_line_ends_at_newline_only_so_unicode_separators_stay_inside_it():
    """U+2028, U+2029 and U+0085 as json.dumps(ensure_ascii=False) and JSON.stringify write them:
    raw, inside a string; a "\\r" before the "\\n" is dropped."""
    texts = ["a\u2028b", "c\u2029d", "e\u0085f"]
    content = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": URL, "body": {
        "model": "m", "messages": [{"role": "user", "content": t}]}}, ensure_ascii=False) + "\r\n"
        for i, t in enumerate(texts))
    good, bad = check_lines(content.encode(), (URL,), lambda m: m == "m", max_lines=100)
    assert bad == []
    assert [(g.custom_id, g.body["messages"][0]["content"]) for g in good] == list(zip(["c0", "c1", "c2"], texts))
