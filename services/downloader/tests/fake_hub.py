"""A fake Hugging Face hub on 127.0.0.1: the parts of the hub API that huggingface_hub's downloads use.

It is a real HTTP server (aiohttp, run in a background thread so that blocking code under test can
call it), shaped after what huggingface_hub 2.4 requests and checks:

    GET  /api/models/{repo_id}[/revision/{revision}][?blobs=true]   repo info: "id", "sha", "siblings"
    GET  /api/models/{repo_id}/tree/{revision}?recursive=...        file listing (one page, no Link header)
    HEAD /{repo_id}/resolve/{revision}/{path}                       file metadata, in the headers only
    GET  /{repo_id}/resolve/{revision}/{path}                       file bytes; "Range: bytes=N-" -> 206

File responses carry what huggingface_hub.file_download needs: X-Repo-Commit (without it the file is
refused as "not served by a Hugging Face Hub endpoint"), a quoted ETag (the git blob sha1, or the
sha256 of an LFS file; for LFS files also X-Linked-Etag / X-Linked-Size, as the hub sends them),
and Content-Length. Errors carry the X-Error-Code header that huggingface_hub maps to its exception
types (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo): huggingface_hub only maps a bare 401
to RepositoryNotFoundError for https:// endpoints, so the code is always sent.

Revisions in URLs are percent-encoded as one segment ("refs%2Fpr%2F1"), so paths are split on the raw
(undecoded) path. No xet: responses never carry X-Xet-Hash, so downloads use plain HTTP.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import msgspec
import pytest
from aiohttp import web

# Files the hub would store in LFS (by suffix); others are plain git blobs.
LFS_SUFFIXES = frozenset(
    {".safetensors", ".bin", ".pth", ".pt", ".gguf", ".onnx", ".h5", ".msgpack", ".model"}
)
LFS_POINTER_SIZE = 134
CHUNK = 64 * 1024


class Seen(msgspec.Struct, frozen=True):
    """One request the hub answered."""

    method: str
    path: str
    """The decoded path, without the query."""
    query: str
    range: str | None
    authorization: str | None


class _File(msgspec.Struct, frozen=True):
    path: str
    disk: Path
    size: int
    blob_id: str
    sha256: str
    lfs: bool

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id


class _Repo(msgspec.Struct):
    commits: dict[str, dict[str, _File]]
    refs: dict[str, str]
    """Branch or tag name -> commit sha."""
    token: str | None = None
    """Set for a gated repo: requests need 'Authorization: Bearer <token>'."""


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _error(status: int, code: str, message: str, *, head: bool) -> web.Response:
    headers = {"X-Error-Code": code, "X-Error-Message": message}
    if head:
        return web.Response(status=status, headers=headers)
    return web.json_response({"error": message}, status=status, headers=headers)


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end exclusive) of 'bytes=start-[end]', or None for the whole file."""
    if not header or not header.startswith("bytes="):
        return None
    start_text, _, end_text = header.removeprefix("bytes=").partition("-")
    start = int(start_text)
    end = int(end_text) + 1 if end_text else size
    return start, min(end, size)


class FakeHub:
    """A hub serving repos added with add_repo; start() before use, stop() after."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = ""
        self.requests: list[Seen] = []
        self._repos: dict[str, _Repo] = {}
        self._drops: dict[tuple[str, str], int] = {}
        self._holds: dict[str, tuple[int, threading.Event]] = {}
        self._commits = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    # --- the test's side ----------------------------------------------------------------------

    def add_repo(
        self, repo_id: str, files: dict[str, bytes], revision: str = "main", *, token: str | None = None
    ) -> str:
        """A new commit holding exactly `files`, which `revision` (a branch or tag) now points to.

        Returns the commit sha. With token, the repo is gated: only that bearer token may read it.
        """
        with self._lock:
            self._commits += 1
            serial = self._commits
        digest = hashlib.sha1(f"{repo_id}\0{revision}\0{serial}".encode())
        for name, data in sorted(files.items()):
            digest.update(name.encode() + b"\0" + data)
        commit = digest.hexdigest()
        stored: dict[str, _File] = {}
        for name, data in files.items():
            disk = self.root / repo_id / commit / name
            disk.parent.mkdir(parents=True, exist_ok=True)
            disk.write_bytes(data)
            stored[name] = _File(
                path=name,
                disk=disk,
                size=len(data),
                blob_id=_blob_id(data),
                sha256=hashlib.sha256(data).hexdigest(),
                lfs=Path(name).suffix in LFS_SUFFIXES,
            )
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo(commits={}, refs={}))
            repo.commits[commit] = stored
            repo.refs[revision] = commit
            if token is not None:
                repo.token = token
        return commit

    def drop_connection_once(self, repo_id: str, path: str, after_bytes: int) -> None:
        """The next GET of that file sends after_bytes of the body, then closes the connection."""
        with self._lock:
            self._drops[(repo_id, path)] = after_bytes

    def hold(self, path: str, after_bytes: int) -> None:
        """GETs of files named path (in any repo) pause after after_bytes of the body until release()."""
        with self._lock:
            self._holds[path] = (after_bytes, threading.Event())

    def release(self, path: str) -> None:
        with self._lock:
            held = self._holds.pop(path, None)
        if held is not None:
            held[1].set()

    def seen(self, method: str | None = None, contains: str = "") -> list[Seen]:
        with self._lock:
            return [r for r in self.requests if (method is None or r.method == method) and contains in r.path]

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._start_site())
            except BaseException as exc:
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=serve, name="fake-hub", daemon=True)
        self._thread.start()
        started.wait(10)
        if failure:
            raise failure[0]
        if not self.url:
            raise RuntimeError("the fake hub did not start")

    async def _start_site(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        with self._lock:
            held = list(self._holds)
        for path in held:
            self.release(path)
        loop, runner = self._loop, self._runner
        if loop is None or self._thread is None:
            return
        if runner is not None:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)

    # --- the server's side --------------------------------------------------------------------

    def _repo_or_error(
        self, request: web.Request, repo_id: str, revision: str | None
    ) -> tuple[str, dict[str, _File]] | web.Response:
        """(commit, files) of repo_id at revision (None = main), or the error response."""
        head = request.method == "HEAD"
        with self._lock:
            repo = self._repos.get(repo_id)
            if repo is None:
                return _error(404, "RepoNotFound", "Repository not found", head=head)
            if repo.token is not None and request.headers.get("Authorization") != f"Bearer {repo.token}":
                status = 403 if "Authorization" in request.headers else 401
                message = (
                    f"Access to model {repo_id} is restricted. You must have access to it"
                    " and be authenticated to access it. Please log in."
                )
                return _error(status, "GatedRepo", message, head=head)
            revision = revision or "main"
            commit = repo.refs.get(revision, revision)
            files = repo.commits.get(commit)
        if files is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head=head)
        return commit, files

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw_path = request.raw_path.partition("?")[0]
        parts = [unquote(part) for part in raw_path.strip("/").split("/")]
        with self._lock:
            self.requests.append(
                Seen(
                    method=request.method,
                    path="/".join(parts),
                    query=request.query_string,
                    range=request.headers.get("Range"),
                    authorization=request.headers.get("Authorization"),
                )
            )
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405)
        match parts:
            case ["api", "models", org, name]:
                return self._info(request, f"{org}/{name}", None)
            case ["api", "models", org, name, "revision", revision]:
                return self._info(request, f"{org}/{name}", revision)
            case ["api", "models", org, name, "tree", revision]:
                return self._tree(request, f"{org}/{name}", revision)
            case [org, name, "resolve", revision, *path] if path:
                return await self._file(request, f"{org}/{name}", revision, "/".join(path))
        return web.Response(status=404, text="no such route on the fake hub")

    def _info(self, request: web.Request, repo_id: str, revision: str | None) -> web.Response:
        found = self._repo_or_error(request, repo_id, revision)
        if isinstance(found, web.Response):
            return found
        commit, files = found
        with_blobs = request.query.get("blobs", "").lower() == "true"
        siblings = []
        for file in sorted(files.values(), key=lambda f: f.path):
            sibling: dict[str, object] = {"rfilename": file.path}
            if with_blobs:
                sibling.update(size=file.size, blobId=file.blob_id)
                if file.lfs:
                    sibling["lfs"] = {
                        "sha256": file.sha256,
                        "size": file.size,
                        "pointerSize": LFS_POINTER_SIZE,
                    }
            siblings.append(sibling)
        body = {"_id": commit[:24], "id": repo_id, "modelId": repo_id, "sha": commit, "private": False}
        body["siblings"] = siblings
        return web.json_response(body)

    def _tree(self, request: web.Request, repo_id: str, revision: str) -> web.Response:
        found = self._repo_or_error(request, repo_id, revision)
        if isinstance(found, web.Response):
            return found
        _, files = found
        recursive = request.query.get("recursive", "").lower() == "true"
        entries: list[dict[str, object]] = []
        folders: set[str] = set()
        for file in sorted(files.values(), key=lambda f: f.path):
            parents = file.path.split("/")[:-1]
            if parents:
                folders.add(parents[0])
                if not recursive:
                    continue
                folders.update("/".join(parents[: depth + 1]) for depth in range(len(parents)))
            entry: dict[str, object] = {
                "type": "file",
                "oid": file.blob_id,
                "size": file.size,
                "path": file.path,
            }
            if file.lfs:
                entry["lfs"] = {"oid": file.sha256, "size": file.size, "pointerSize": LFS_POINTER_SIZE}
            entries.append(entry)
        entries += [
            {"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest(), "size": 0, "path": folder}
            for folder in sorted(folders)
            if recursive or "/" not in folder
        ]
        return web.Response(body=json.dumps(entries), content_type="application/json")

    async def _file(self, request: web.Request, repo_id: str, revision: str, path: str) -> web.StreamResponse:
        found = self._repo_or_error(request, repo_id, revision)
        if isinstance(found, web.Response):
            return found
        commit, files = found
        file = files.get(path)
        head = request.method == "HEAD"
        if file is None:
            return _error(404, "EntryNotFound", f"{path} does not exist on {revision!r}", head=head)
        headers = {
            "X-Repo-Commit": commit,
            "ETag": f'"{file.etag}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if file.lfs:
            headers["X-Linked-Etag"] = f'"{file.sha256}"'
            headers["X-Linked-Size"] = str(file.size)
        if head:
            headers["Content-Length"] = str(file.size)
            return web.Response(status=200, headers=headers)

        span = _byte_range(request.headers.get("Range"), file.size)
        start, end = span or (0, file.size)
        status = 206 if span is not None else 200
        if span is not None:
            if start >= file.size:
                return web.Response(status=416, headers={"Content-Range": f"bytes */{file.size}"})
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{file.size}"
        headers["Content-Length"] = str(end - start)
        with self._lock:
            drop_after = self._drops.pop((repo_id, path), None)
            hold_after, released = self._holds.get(path, (None, None))

        response = web.StreamResponse(status=status, headers=headers)
        await response.prepare(request)
        sent = 0
        with file.disk.open("rb") as data:
            data.seek(start)
            while sent < end - start:
                chunk = data.read(min(CHUNK, end - start - sent))
                if drop_after is not None and sent + len(chunk) >= drop_after:
                    await response.write(chunk[: drop_after - sent])
                    assert request.transport is not None
                    request.transport.close()  # the client sees a body shorter than Content-Length
                    return response
                if hold_after is not None and released is not None and sent + len(chunk) > hold_after:
                    await response.write(chunk[: hold_after - sent])
                    chunk = chunk[hold_after - sent :]
                    sent, hold_after = hold_after, None
                    while not released.is_set():
                        await asyncio.sleep(0.01)
                await response.write(chunk)
                sent += len(chunk)
        await response.write_eof()
        return response


@pytest.fixture(name="fake_hub")
def fake_hub_fixture(tmp_path: Path) -> Iterator[FakeHub]:
    """A started FakeHub; import fake_hub_fixture into a test module to use the `fake_hub` fixture."""
    hub = FakeHub(tmp_path / "fake-hub")
    hub.start()
    try:
        yield hub
    finally:
        hub.stop()
