"""A local stand-in for the Hugging Face hub's HTTP API, as much of it as `huggingface_hub`'s
`model_info(files_metadata=True)` and `hf_hub_download` use:

    GET  /api/models/{owner}/{name}[/revision/{rev}]   the commit and its files (size, blob id, LFS sha256)
    HEAD /{owner}/{name}/resolve/{rev}/{file}          X-Repo-Commit, ETag, Content-Length
    GET  /{owner}/{name}/resolve/{rev}/{file}          the bytes, honouring `Range: bytes=N-`

Errors as the hub sends them (401 + X-Error-Code: RepoNotFound, 403 + GatedRepo). Each request is
logged; a file can be set to break off once after some bytes (an interrupted transfer)."""

import asyncio
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

LFS_SUFFIXES = (".safetensors", ".gguf")


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool = False
    declared_sizes: dict[str, int] = field(default_factory=dict)  # sizes the listing claims
    corrupt: set[str] = field(default_factory=set)  # served with one byte changed

    @classmethod
    def from_folder(cls, folder: Path, **kwargs) -> "Repo":
        return cls({p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()},
                   **kwargs)


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


def _etag(name: str, data: bytes) -> str:
    return hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES) else _blob_id(data)


class HubStandIn:
    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.break_after: dict[str, int] = {}  # file -> bytes sent before the connection drops
        self.pace_s = 0.0  # a pause before each of a file's first 8 chunks of 64 KB (a download to watch)
        self.app = Starlette(routes=[
            Route("/health", lambda r: JSONResponse({"status": "ok"})),
            Route("/api/models/{owner}/{name}", self.info),
            Route("/api/models/{owner}/{name}/revision/{rev}", self.info),
            Route("/{owner}/{name}/resolve/{rev}/{path:path}", self.resolve, methods=["GET", "HEAD"]),
        ])

    def _repo(self, request: Request) -> tuple[str, Repo | None]:
        repo_id = f"{request.path_params['owner']}/{request.path_params['name']}"
        return repo_id, self.repos.get(repo_id)

    @staticmethod
    def _not_found() -> Response:
        return JSONResponse({"error": "Repository not found"}, status_code=401,
                            headers={"X-Error-Code": "RepoNotFound"})

    async def info(self, request: Request) -> Response:
        self.log.append((request.method, request.url.path, None))
        repo_id, repo = self._repo(request)
        if repo is None:
            return self._not_found()
        siblings = []
        for name, data in repo.files.items():
            size = repo.declared_sizes.get(name, len(data))
            entry = {"rfilename": name, "size": size, "blobId": _blob_id(data)}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": size,
                                "pointerSize": 134}
            siblings.append(entry)
        return JSONResponse({"_id": repo_id, "id": repo_id, "modelId": repo_id, "sha": repo.sha,
                             "private": False, "gated": "auto" if repo.gated else False,
                             "disabled": False, "downloads": 0, "likes": 0, "tags": [],
                             "siblings": siblings})

    async def resolve(self, request: Request) -> Response:
        self.log.append((request.method, request.url.path, request.headers.get("range")))
        _, repo = self._repo(request)
        if repo is None:
            return self._not_found()
        if repo.gated:
            return JSONResponse({"error": "Access to this model is restricted"}, status_code=403,
                                headers={"X-Error-Code": "GatedRepo"})
        name = request.path_params["path"]
        if name not in repo.files:
            return JSONResponse({"error": "Entry not found"}, status_code=404,
                                headers={"X-Error-Code": "EntryNotFound"})
        data = repo.files[name]
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{_etag(name, data)}"',
                   "Accept-Ranges": "bytes"}
        if name in repo.corrupt:
            data = bytes([data[0] ^ 1]) + data[1:]
        start = 0
        if request.headers.get("range", "").startswith("bytes="):
            start = int(request.headers["range"][6:].split("-")[0])
        body = data[start:]
        headers["Content-Length"] = str(len(body))
        status = 200
        if start:
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if request.method == "HEAD":
            return Response(status_code=status, headers=headers)
        cut = self.break_after.pop(name, None)

        async def chunks():
            for i in range(0, len(body), 1 << 16):
                if cut is not None and i >= cut:
                    raise ConnectionAbortedError("stand-in: transfer interrupted on purpose")
                if self.pace_s and i < 8 << 16:
                    await asyncio.sleep(self.pace_s)
                yield body[i:i + (1 << 16)]

        return StreamingResponse(chunks(), status_code=status, headers=headers)
