"""A Hugging Face hub cache laid out as huggingface_hub writes it, for tests that cannot reach a hub.

HF_HOME/hub/models--<org>--<name>/
    blobs/<sha256 of the file>             the bytes, once per content
    snapshots/<commit>/<file>              a relative symlink to ../../blobs/<sha>
    refs/<revision>                        the commit the branch or tag points at (no newline)
With HF_HUB_OFFLINE=1 (or an unreachable hub), snapshot_download resolves the revision through refs/ and
returns the snapshot folder: the code path `graphcache serve org/name` takes on a machine with a
populated cache.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(
    hf_home: Path, repo_id: str, source: Path, *, revision: str = "main", commit: str = COMMIT
) -> Path:
    """Put the files of `source` (a model directory) into HF_HOME's hub cache as `repo_id` at
    `revision`; returns the snapshot folder."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in source.iterdir() if p.is_file()):
        data = file.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        (blobs / sha).write_bytes(data)
        link = snapshot / file.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path("..") / ".." / "blobs" / sha)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


def hub_env(hf_home: Path, **extra: str) -> dict[str, str]:
    """The environment of a server process that uses only this HF_HOME: no GRAPHCACHE_* or HF_* of the
    caller's shell leaks in (a token or an endpoint there would change what is tested)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAPHCACHE_", "HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(hf_home), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def resolve_in_subprocess(
    spec: str, env: dict[str, str], revision: str | None = None
) -> subprocess.CompletedProcess:
    """fetch_hub_model in a fresh interpreter, so huggingface_hub reads HF_HOME and HF_HUB_* from `env`
        at import, as a server process does. Prints each progress report ("PROGRESS {json}"), then the
    snapshot folder, or "ERROR <message>" (exit 3)."""
    code = (
        "import json, sys, threading\n"
        "from graphcache.model.source import ModelSourceError, fetch_hub_model\n"
        "lock = threading.Lock()\n"
        "def report(progress):\n"  # called from the library's download threads
        "    with lock:\n"
        "        sys.stdout.write('PROGRESS ' + json.dumps(progress) + '\\n')\n"
        "        sys.stdout.flush()\n"
        "try:\n"
        f"    print(fetch_hub_model({spec!r}, {revision!r}, report))\n"
        "except ModelSourceError as e:\n"
        "    print('ERROR', e)\n"
        "    sys.exit(3)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


# --------------------------------------------------------------------------- a hub endpoint on loopback


class FakeHub:
    """A minimal hub API on a loopback port (HF_ENDPOINT=hub.url): repo_info, the tree listing and file
    downloads of the repositories in `repos` (repo id -> model directory), each at COMMIT. Error
    answers as the hub sends them (an X-Error-Code header): `gated` repo ids answer 403 GatedRepo, an
    unknown repo 404 RepoNotFound (401, as the hub answers anonymous callers), a revision other than
    main or COMMIT 404 RevisionNotFound. A file named in `cut_once` has its first download cut off
    halfway (the connection closes), as a flaky network does; a Range request is answered 206 from the
    offset asked, as the hub does, so the library's retry resumes."""

    def __init__(
        self, repos: dict[str, Path], gated: tuple[str, ...] = (), cut_once: tuple[str, ...] = ()
    ) -> None:
        import http.server
        import threading

        self.repos, self.gated, self.cut_once = repos, set(gated), set(cut_once)
        self.requests: list[str] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet test output
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, handler, body: bool) -> None:
        import json
        import re
        from urllib.parse import unquote, urlsplit

        path = unquote(urlsplit(handler.path).path)
        self.requests.append(f"{handler.command} {path}")
        api = re.match(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(?:/.*)?)?$", path)
        resolve = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        match = api or resolve
        if match is None:
            return self._send(handler, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)
        repo = match.group(1)
        revision = (match.group(3) if api else match.group(2)) or "main"
        if repo in self.gated:
            return self._send(handler, 403, b'{"error": "gated"}', {"X-Error-Code": "GatedRepo"}, body)
        if repo not in self.repos:
            return self._send(handler, 401, b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound"}, body)
        if revision not in ("main", COMMIT):
            return self._send(handler, 404, b'{"error": "rev"}', {"X-Error-Code": "RevisionNotFound"}, body)
        files = {p.name: p for p in sorted(self.repos[repo].iterdir()) if p.is_file()}
        if api and api.group(2) == "tree":
            listing = [
                {"type": "file", "path": name, "size": p.stat().st_size, "oid": _sha1(p)}
                for name, p in files.items()
            ]
            return self._send(handler, 200, json.dumps(listing).encode(), {}, body)
        if api:
            info = {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": n} for n in files]}
            return self._send(handler, 200, json.dumps(info).encode(), {}, body)
        name = resolve.group(3)
        if name not in files:
            return self._send(handler, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)
        data = files[name].read_bytes()
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
        if body and name in self.cut_once:
            self.cut_once.discard(name)
            return self._cut_off(handler, data, headers)
        offset = re.match(r"^bytes=(\d+)-$", handler.headers.get("Range") or "")
        if body and offset:
            start = int(offset.group(1))
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return self._send(handler, 206, data[start:], headers, body)
        return self._send(handler, 200, data, headers, body)

    @staticmethod
    def _cut_off(handler, data: bytes, headers: dict[str, str]) -> None:
        """Announce all of `data`, send half, and close the connection."""
        import socket

        handler.send_response(200)
        for key, value in {"Content-Length": str(len(data)), **headers}.items():
            handler.send_header(key, value)
        handler.end_headers()
        handler.wfile.write(data[: len(data) // 2])
        handler.wfile.flush()
        handler.close_connection = True
        handler.connection.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _send(handler, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
        handler.send_response(status)
        for key, value in {"Content-Length": str(len(data)), **headers}.items():
            handler.send_header(key, value)
        handler.end_headers()
        if body:
            handler.wfile.write(data)


def _sha1(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()
