"""`pyserve router` over two `pyserve serve` replicas on loopback: routing by prefix, streams
passed through, /v1/models and /metrics gathered, retries (a replica unreachable or refusing),
a replica that stops answering, a replica killed (mid-stream too), and servers that are not
replicas refused."""

from __future__ import annotations

import http.server
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from pyserve.replicas.front import REPLICA_HEADER
from pyserve.server.child_server import free_port, start_router
from pyserve.testing import parse_metrics, start_server, stop_server

MODEL = "tiny"


def start_replica(model_dir) -> tuple[subprocess.Popen, str]:
    return start_server(model_dir, "--served-model-name", MODEL, "--block-size", "4", "--num-kv-blocks", "256",
                        "--embedding-model", "none", workdir=model_dir.parent)


@pytest.fixture(scope="module")
def replicas(model_dirs):
    started = [start_replica(model_dirs["llama"]) for _ in range(2)]
    yield started
    for proc, _ in started:
        if proc.poll() is None:
            stop_server(proc)


@pytest.fixture(scope="module")
def router(replicas, model_dirs):
    proc, base = start_router([url for _, url in replicas], "--health-interval", "0.1",
                              workdir=model_dirs["llama"].parent)
    yield base
    stop_server(proc)


def chat(base: str, messages: list[dict], **kw) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, **kw}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=60)


def answering(base: str, n: int, tag: str) -> set[str]:
    """The replicas that answered `n` one-line chats, each with 200."""
    seen = set()
    for i in range(n):
        r = chat(base, [{"role": "user", "content": f"{tag} {i}"}])
        assert r.status_code == 200, r.text
        seen.add(r.headers[REPLICA_HEADER])
    return seen


def test_a_conversation_stays_on_the_replica_holding_its_prefix(router, replicas):
    urls = {url for _, url in replicas}
    system = {"role": "system", "content": "You answer in Python. " * 8}
    seen = {}
    for conv in ("parse a date", "sort a list", "read a file", "count words"):
        history = [system, {"role": "user", "content": conv}]
        picks = []
        for turn in range(3):
            r = chat(router, history)
            assert r.status_code == 200, r.text
            picks.append(r.headers[REPLICA_HEADER])
            history += [r.json()["choices"][0]["message"], {"role": "user", "content": f"and then {turn}"}]
        assert len(set(picks)) == 1, picks  # every turn where the conversation's prefix is cached
        seen[conv] = picks[0]
    assert set(seen.values()) <= urls
    series = parse_metrics(httpx.get(router + "/metrics").text)
    # Every follow-up turn was routed by its cached prefix.
    assert sum(v for k, v in series.items() if k.startswith("pyserve_router:requests_total")
               and 'reason="cache_match"' in k) >= 8


def test_streams_pass_through_unchanged(router, replicas):
    direct = openai.OpenAI(base_url=replicas[0][1] + "/v1", api_key="x", max_retries=0)
    routed = openai.OpenAI(base_url=router + "/v1", api_key="x", max_retries=0)
    kw = dict(model=MODEL, prompt="def add(a, b):", max_tokens=12, temperature=0, stream=True,
              stream_options={"include_usage": True})
    want = list(direct.completions.create(**kw))
    got = list(routed.completions.create(**kw))
    assert "".join(c.choices[0].text for c in got if c.choices) == "".join(c.choices[0].text for c in want if c.choices)
    assert got[-1].usage.completion_tokens == want[-1].usage.completion_tokens == 12


def test_errors_come_back_as_the_replica_sent_them(router):
    r = chat(router, [{"role": "user", "content": "hi"}], max_tokens=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(router + "/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400


def test_models_and_metrics_gather_every_replica(router, replicas):
    models = httpx.get(router + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(f"{router}/v1/models/{MODEL}").json() == models["data"][0]
    assert httpx.get(router + "/v1/models/nope").status_code == 404
    assert httpx.get(router + "/version").json()["version"] == httpx.get(replicas[0][1] + "/version").json()["version"]
    text = httpx.get(router + "/metrics").text
    for _, url in replicas:
        assert f'pyserve:num_requests_running{{replica="{url}",model="{MODEL}"}} 0' in text
        assert f'pyserve_router:replica_healthy{{replica="{url}"}} 1' in text
    assert text.count("# TYPE pyserve:num_requests_running ") == 1


def test_stats_and_the_web_pages_are_served_for_every_replica(router, replicas):
    """The dashboard and playground behind the router read /v1/stats summed over the replicas."""
    chat(router, [{"role": "user", "content": "count me"}])
    own = [httpx.get(url + "/v1/stats").json() for _, url in replicas]
    merged = httpx.get(router + "/v1/stats").json()
    assert sorted(merged["models"]) == sorted(f"{MODEL}@{url}" for _, url in replicas)
    assert merged["requests"][MODEL][""] == sum(s["requests"][MODEL][""] for s in own) >= 1
    assert merged["latency"]["e2e"]["count"] == sum(s["latency"]["e2e"]["count"] for s in own)
    for path, kind in (("/", "text/html"), ("/dashboard", "text/html"), ("/web/dashboard.js", "text/javascript")):
        r = httpx.get(router + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert r.content == httpx.get(replicas[0][1] + path).content


def test_unreachable_replica_is_retried_elsewhere(replicas, model_dirs):
    dead = f"http://127.0.0.1:{free_port()}"
    live = replicas[1][1]
    proc, base = start_router([dead, live], "--policy", "round_robin", workdir=model_dirs["llama"].parent)
    try:
        health = httpx.get(base + "/health").json()
        assert health == {"status": "ok", "replicas_healthy": 1, "replicas": 2}
        for i in range(4):
            r = chat(base, [{"role": "user", "content": f"q{i}"}])
            assert r.status_code == 200 and r.headers[REPLICA_HEADER] == live
    finally:
        stop_server(proc)


class _NotAModelServer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"<html>hello</html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_router_with_its_own_key_presents_the_replicas_key_upstream(model_dirs):
    """Clients hold the router's key (ck), replicas want theirs (rk): the router checks ck and
    sends rk, for forwarded requests and for the lists it gathers."""
    proc, url = start_server(model_dirs["llama"], "--served-model-name", MODEL, "--block-size", "4",
                             "--num-kv-blocks", "64", "--embedding-model", "none", "--api-key", "rk",
                             workdir=model_dirs["llama"].parent)
    router_proc = None
    try:
        router_proc, base = start_router([url], "--api-key", "ck", "--replica-api-key", "rk", "--public-metrics",
                                         "--allowed-origins", "https://app.example", workdir=model_dirs["llama"].parent)
        client = {"Authorization": "Bearer ck"}
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, headers=client,
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert [m["id"] for m in httpx.get(base + "/v1/models", headers=client).json()["data"]] == [MODEL]
        assert httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                          headers={"Authorization": "Bearer rk"}).status_code == 401  # the router's own key
        assert httpx.get(base + "/v1/stats", headers=client).json()["requests"][MODEL][""] == 1
        assert httpx.get(base + "/v1/stats").json()["requests"][MODEL][""] == 1  # --public-metrics
        assert httpx.get(base + "/v1/models").status_code == 401
        preflight = httpx.options(base + "/v1/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization"})
        assert (preflight.status_code, preflight.headers["access-control-allow-origin"]) == (200, "https://app.example")
        assert httpx.get(base + "/dashboard").status_code == 200  # the page asks for the key itself
        # A router without a key of its own is open: its key for replicas goes with a keyless
        # client's requests as with the lists it gathers; a client's own wrong key is refused.
        stop_server(router_proc)
        router_proc, base = start_router([url], "--replica-api-key", "rk", workdir=model_dirs["llama"].parent)
        assert httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                          timeout=60).status_code == 200
        assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == MODEL
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    finally:
        if router_proc is not None:
            stop_server(router_proc)
        stop_server(proc)


def test_a_server_that_is_not_a_replica_is_refused(model_dirs):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotAModelServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        done = subprocess.run([sys.executable, "-m", "pyserve.cli", "router", "--replica", url, "--port",
                               str(free_port())], capture_output=True, text=True, timeout=60,
                              cwd=model_dirs["llama"].parent)
    finally:
        httpd.shutdown()
    assert done.returncode != 0
    assert f"replica {url}: GET /v1/models answered 200 text/html that is not JSON" in done.stderr


def test_the_routers_own_errors_are_openai_json(router):
    r = httpx.get(router + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(router + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert "POST" in r.headers["allow"]


class _Fake(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server listing `models` whose POSTs `post` answers."""

    models: tuple[str, ...] = (MODEL,)
    protocol_version = "HTTP/1.1"

    def answer(self, status: int, body: dict, headers=()):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            return self.answer(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})
        self.answer(200, {"status": "ok"})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.post()

    def post(self):
        raise NotImplementedError

    def log_message(self, *args):
        pass


def fake(post, models=(MODEL,), port: int = 0) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = type("Handler", (_Fake,), {"post": post, "models": tuple(models)})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def _queue_full(h: _Fake):
    h.answer(429, {"error": {"message": "queue full", "type": "rate_limit_error", "param": None, "code": None}},
             [("Retry-After", "7")])


def _no_such_model(h: _Fake):
    h.answer(404, {"error": {"message": "no such model", "type": "not_found_error", "param": "model",
                             "code": "model_not_found"}})


def _answers_as_other(h: _Fake):
    h.answer(200, {"object": "chat.completion", "model": "other", "choices": []})


def _cut_mid_event(h: _Fake):
    """A stream whose connection drops inside its second event (the chunked body never ends)."""
    h.send_response(200)
    h.send_header("Content-Type", "text/event-stream")
    h.send_header("Transfer-Encoding", "chunked")
    h.end_headers()
    for piece in (b'data: {"id": "x", "choices": []}\n\n', b'data: {"id": "x", "object": "chat.compl'):
        h.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        h.wfile.flush()
        time.sleep(0.05)
    h.close_connection = True


@pytest.fixture()
def routers(model_dirs):
    """Starts routers over the given replica URLs (and flags); stops them at the end."""
    started = []

    def start(urls: list[str], *flags: str) -> str:
        started.append(start_router(urls, *flags, workdir=model_dirs["llama"].parent))
        return started[-1][1]

    yield start
    for proc, _ in started:
        stop_server(proc)


@pytest.fixture()
def fakes():
    """Starts fake replicas (see `fake`); shuts them down at the end."""
    started = []

    def start(post, models=(MODEL,), port: int = 0) -> str:
        httpd, url = fake(post, models, port)
        started.append(httpd)
        return url

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


def test_a_refused_request_is_sent_to_another_replica(replicas, routers, fakes):
    full, live = fakes(_queue_full), replicas[1][1]
    base = routers([full, live], "--policy", "round_robin")
    assert answering(base, 4, "q") == {live}
    series = parse_metrics(httpx.get(base + "/metrics").text)
    # Round-robin's cursor moves on each pick, the retry's included: every request tries `full` first.
    assert series['pyserve_router:retries_total{reason="refused"}'] == 4
    # Every replica refusing: the client gets the refusal as the replica sent it.
    r = chat(routers([full]), [{"role": "user", "content": "q"}])
    assert r.status_code == 429 and r.json()["error"]["message"] == "queue full"
    assert r.headers["retry-after"] == "7" and r.headers[REPLICA_HEADER] == full


def test_a_request_goes_to_the_replicas_serving_its_model(replicas, routers, fakes):
    """One replica serves `other` only, the live one `tiny`: each request goes where its model is
    listed; a replica answering model_not_found for a model it listed is retried elsewhere."""
    other, stale, live = fakes(_answers_as_other, models=["other"]), fakes(_no_such_model), replicas[1][1]
    base = routers([other, live], "--policy", "round_robin")
    assert answering(base, 4, "q") == {live}
    for _ in range(4):
        r = httpx.post(base + "/v1/chat/completions", json={"model": "other", "messages": []}, timeout=10)
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == other and r.json()["model"] == "other"
    series = parse_metrics(httpx.get(base + "/metrics").text)
    assert sum(v for k, v in series.items() if k.startswith("pyserve_router:retries_total")) == 0  # none astray
    base = routers([stale, live], "--policy", "round_robin")
    assert answering(base, 3, "s") == {live}
    # The stale one answered once; then its list no longer holds the model, so it is left out.
    series = parse_metrics(httpx.get(base + "/metrics").text)
    assert series['pyserve_router:retries_total{reason="refused"}'] == 1


def test_a_stream_cut_inside_an_event_ends_with_a_whole_error_event(routers, fakes):
    base = routers([fakes(_cut_mid_event)])
    r = httpx.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": [], "stream": True}, timeout=10)
    events = [e for e in r.text.split("\n\n") if e]
    assert json.loads(events[0].removeprefix("data: ")) == {"id": "x", "choices": []}
    error = json.loads(events[-2].removeprefix("data: "))["error"]  # each event whole JSON: the half one dropped
    assert len(events) == 3 and error["type"] == "bad_gateway" and "failed mid-stream" in error["message"]
    assert events[-1] == "data: [DONE]"


def test_a_client_that_leaves_a_non_streamed_request_frees_the_replica(router, replicas):
    body = {"model": MODEL, "prompt": "def long(one):", "max_tokens": 480, "n": 16, "ignore_eos": True,
            "temperature": 1.0}  # 16 x 480 tokens through a 1,024-token KV pool: some seconds
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.2))
    deadline = started + 20
    while any(parse_metrics(httpx.get(url + "/metrics").text, MODEL)["pyserve:num_requests_running"]
              for _, url in replicas):
        assert time.monotonic() < deadline, "the replica kept generating for a client that left"
        time.sleep(0.05)
    gone = time.monotonic() - started
    whole = httpx.post(router + "/v1/completions", json=body, timeout=120)
    assert whole.status_code == 200 and gone < whole.elapsed.total_seconds() / 2  # cut, not run to the end


def test_a_port_that_answered_something_else_serves_once_a_replica_is_there(replicas, routers, fakes):
    """After the router started, a non-model answer on a replica's port (a proxy's page while a pod
    restarts) keeps it out only while it lasts."""
    port = free_port()
    base = routers([f"http://127.0.0.1:{port}", replicas[1][1]], "--health-interval", "0.1")
    page = http.server.ThreadingHTTPServer(("127.0.0.1", port), _NotAModelServer)
    threading.Thread(target=page.serve_forever, daemon=True).start()
    time.sleep(0.5)
    assert httpx.get(base + "/health").json()["replicas_healthy"] == 1
    page.shutdown()
    page.server_close()
    fakes(_queue_full, port=port)
    deadline = time.monotonic() + 10
    while httpx.get(base + "/health").json()["replicas_healthy"] != 2:
        assert time.monotonic() < deadline, "the replica's port stayed refused"
        time.sleep(0.05)


def test_a_replica_that_stops_answering_ends_its_requests(replicas, model_dirs):
    """SIGSTOP: the replica's sockets stay open and nothing comes back. Once its health checks
    have failed for --lost-timeout, its stream ends with an error event and a request waiting
    for its answer gets 504; it serves again once continued."""
    proc, url = replicas[0]
    router_proc, base = start_router([url], "--health-interval", "0.1", "--lost-timeout", "1",
                                     workdir=model_dirs["llama"].parent)

    def wait_healthy():
        deadline = time.monotonic() + 30
        while httpx.get(base + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)

    body = {"model": MODEL, "prompt": "def stop(me):", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "temperature": 0}
    try:
        lines = []
        with httpx.Client(timeout=60) as client, client.stream("POST", base + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                if len(lines) == 3:
                    proc.send_signal(signal.SIGSTOP)
                    stopped_at = time.monotonic()
        assert time.monotonic() - stopped_at < 10
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert error["type"] == "gateway_timeout" and "stopped answering mid-stream" in error["message"]
        proc.send_signal(signal.SIGCONT)
        wait_healthy()
        proc.send_signal(signal.SIGSTOP)  # before the router notices: the request reaches the stopped replica
        r = chat(base, [{"role": "user", "content": "are you there?"}])
        assert r.status_code == 504 and "stopped answering" in r.json()["error"]["message"]
        proc.send_signal(signal.SIGCONT)
        wait_healthy()
        assert chat(base, [{"role": "user", "content": "and now?"}]).status_code == 200
    finally:
        proc.send_signal(signal.SIGCONT)
        stop_server(router_proc)


def test_a_killed_replica_ends_its_streams_and_loses_its_traffic(router, replicas):
    """Last in the module: it kills the replica a stream lands on."""
    procs = dict((url, proc) for proc, url in replicas)
    body = {"model": MODEL, "prompt": "def kill(me):", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "temperature": 0}
    lines = []
    with httpx.Client(timeout=60) as client, client.stream("POST", router + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        victim = r.headers[REPLICA_HEADER]
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
            if len(lines) == 3:
                procs[victim].send_signal(signal.SIGKILL)
    assert len(lines) > 4 and '"error"' in lines[-2] and "failed mid-stream" in lines[-2] and lines[-1] == "data: [DONE]"
    killed_at = time.monotonic()
    while httpx.get(router + "/health").json()["replicas_healthy"] != 1:
        assert time.monotonic() - killed_at < 1.0, "the router kept the dead replica for over a second"
        time.sleep(0.05)
    survivor = next(url for url in procs if url != victim)
    for i in range(4):
        r = chat(router, [{"role": "user", "content": f"after {i}"}])
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == survivor
