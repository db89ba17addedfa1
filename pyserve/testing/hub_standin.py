"""A local stand-in for the Hugging Face Hub's HTTP API (the hub itself is unreachable here), enough
for huggingface_hub's snapshot_download: a repository's file list at a revision
(`/api/models/{repo}/revision/{rev}`) and its files (`/{repo}/resolve/{rev}/{file}`, HEAD and GET),
repositories gated (401) or missing (404) and revisions other than `main` and the repository's
commit (404) as the hub answers them. Point HF_ENDPOINT at `url`."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class HubStandIn:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}  # repo id -> file name -> content
        self.gated: set[str] = set()
        self.requests: list[str] = []  # "METHOD path", in order
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add_folder(self, repo: str, folder: Path) -> None:
        self.repos[repo] = {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}

    def commit(self, repo: str) -> str:
        digest = hashlib.sha1(repo.encode())
        for name, data in sorted(self.repos[repo].items()):
            digest.update(name.encode() + hashlib.sha1(data).digest())
        return digest.hexdigest()

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append(f"{self.command} {path}")
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo = "/".join(parts[2:4])
                    if not self._visible(repo):
                        return
                    if len(parts) >= 6 and parts[4] in ("revision", "tree") and not self._known(repo, parts[5]):
                        return
                    if len(parts) >= 6 and parts[4] == "tree":
                        tree = [{"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                                for n, d in sorted(hub.repos[repo].items())]
                        return self._send(200, json.dumps(tree).encode(), body, {"Content-Type": "application/json"})
                    info = {"id": repo, "modelId": repo, "sha": hub.commit(repo), "private": False,
                            "gated": repo in hub.gated, "siblings": [{"rfilename": n} for n in sorted(hub.repos[repo])]}
                    return self._send(200, json.dumps(info).encode(), body, {"Content-Type": "application/json"})
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo, name = "/".join(parts[:2]), "/".join(parts[4:])
                    if not self._visible(repo) or not self._known(repo, parts[3]):
                        return
                    data = hub.repos[repo].get(name)
                    if data is None:
                        return self._send(404, b"Entry not found", body, {"X-Error-Code": "EntryNotFound"})
                    headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": hub.commit(repo),
                               "Content-Type": "application/octet-stream"}
                    return self._send(200, data, body, headers)
                self._send(404, b"not found", body, {})

            def _visible(self, repo: str) -> bool:
                if repo not in hub.repos:
                    self._send(404, b"Repository not found", True,
                               {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
                    return False
                if repo in hub.gated and "authorization" not in {k.lower() for k in self.headers}:
                    self._send(401, b"Access to this model is restricted", True,
                               {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this model is restricted"})
                    return False
                return True

            def _known(self, repo: str, revision: str) -> bool:
                if revision in ("main", hub.commit(repo)):
                    return True
                self._send(404, b"Invalid rev id", True,
                           {"X-Error-Code": "RevisionNotFound", "X-Error-Message": f"Invalid rev id: {revision}"})
                return False

            def _send(self, status: int, data: bytes, body: bool, headers: dict[str, str]) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body and self.command != "HEAD":
                    self.wfile.write(data)

        return Handler
