"""`pyserve serve --data-parallel-size N`: N replica processes behind the router (their semantic
caches reached through it too)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from pyserve.replicas.front import REPLICA_HEADER
from pyserve.replicas.local import LocalReplicas, replica_argv
from pyserve.server.child_server import free_port
from pyserve.testing import start_server, stop_server


def test_the_front_keeps_its_own_flags():
    argv = ["serve", "m", "--port", "9", "--data-parallel-size=2", "--host", "0.0.0.0", "--api-key", "k",
            "--data-parallel-size", "2"]
    assert replica_argv(argv) == ["serve", "m", "--api-key", "k"]


def test_a_replicas_command_line_holds_no_key():
    """`ps` shows every local user a process's command line: the key goes in the environment."""
    replicas = LocalReplicas(["serve", "m", "--api-key", "s3cret", "--data-parallel-size", "2"], 2)
    assert replicas.argv == ["serve", "m"]
    assert not any("s3cret" in arg for arg in replicas.command(0))
    assert replicas.secrets == {"PYSERVE_API_KEY": "s3cret"}


def test_two_local_replicas_serve_behind_one_port(model_dirs, tmp_path):
    """Started from a folder holding a decoy `pyserve` package (as the repository's root holds
    its source tree): the front and its replicas import the installed one."""
    model = model_dirs["llama"]
    (tmp_path / "pyserve").mkdir()
    (tmp_path / "pyserve" / "__init__.py").write_text("raise ImportError('the decoy pyserve was imported')\n")
    proc, base = start_server(model, "--data-parallel-size", "2", "--served-model-name", "tiny", "--semantic-cache",
                              "--api-key", "k", workdir=tmp_path)
    auth = {"Authorization": "Bearer k"}
    try:
        deadline = time.monotonic() + 120
        while httpx.get(base + "/health").json()["replicas_healthy"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        replicas = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _parent(d) == proc.pid]
        assert [Path(f"/proc/{pid}/cwd").resolve() for pid in replicas] == [tmp_path.resolve()] * 2
        for pid in [proc.pid, *replicas]:  # the key is on no command line
            assert b"k" not in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 401
        seen = set()
        for i in range(6):
            body = {"model": "tiny", "prompt": f"{i} is a new prompt", "max_tokens": 3, "temperature": 0}
            r = httpx.post(base + "/v1/completions", json=body, headers=auth, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            seen.add(r.headers[REPLICA_HEADER])
        assert len(seen) == 2  # cold prompts go where the least is cached: both replicas serve
        for url in seen:  # each replica still holds its clients to the key
            assert httpx.get(url + "/v1/models").status_code == 401
            assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
        text = httpx.get(base + "/metrics", headers=auth).text
        assert all(f'pyserve:num_requests_running{{replica="{url}",model="tiny"}} 0' in text for url in seen)
        # Each replica's semantic cache, through the front: figures summed, invalidation sent to each.
        ask = {"model": "tiny", "messages": [{"role": "user", "content": "What is a tuple?"}], "max_tokens": 3,
               "temperature": 0}
        assert httpx.post(base + "/v1/chat/completions", json=ask, headers=auth, timeout=60).status_code == 200
        cache = httpx.get(base + "/v1/cache", headers=auth).json()
        assert cache["stores"] == 1 == sum(f["stores"] for f in cache["replicas"].values())
        assert len(cache["replicas"]) == 2
        dropped = httpx.post(base + "/v1/cache/invalidate", json={}, headers=auth).json()
        assert dropped == {"invalidated": 1, "replicas": 2}
        assert httpx.get(base + "/v1/cache", headers=auth).json()["entries"] == 0
    finally:
        assert stop_server(proc) == 0
    for url in seen:  # the replicas went with the front
        try:
            httpx.get(url + "/health", timeout=2)
            raise AssertionError(f"replica {url} still answers")
        except httpx.ConnectError:
            pass


def test_replicas_that_cannot_start_fail_the_command(model_dirs, tmp_path):
    """A replica that exits before it ever served is not restarted forever: the command exits
    non-zero naming it."""
    model = model_dirs["llama"]
    done = subprocess.run([sys.executable, "-m", "pyserve.cli", "serve", str(model), "--data-parallel-size", "2",
                           "--port", str(free_port()), "--embedding-model", "none", "--quantization", "bogus"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    assert "exited with 1 before it served" in done.stderr


def test_a_replica_dies_with_its_parent(model_dirs, tmp_path):
    model = model_dirs["llama"]
    front = subprocess.Popen([sys.executable, "-m", "pyserve.cli", "serve", str(model), "--data-parallel-size", "2",
                              "--port", str(free_port()), "--embedding-model", "none", "--num-kv-blocks", "64"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    time.sleep(3)
    children = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _parent(d) == front.pid]
    assert len(children) == 2
    front.kill()
    front.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in children):
        assert time.monotonic() < deadline, "a replica outlived its parent"
        time.sleep(0.2)


def _parent(proc_dir: Path) -> int | None:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False
