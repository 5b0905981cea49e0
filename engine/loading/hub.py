"""Downloading models from a Hugging Face hub (`mlxchat pull REPO[:FILE]`) and removing them.

Downloads go through `huggingface_hub` into its standard cache (HF_HUB_CACHE), at the hub that
HF_ENDPOINT names. A transfer that breaks off resumes from where it stopped (huggingface_hub's
`http_get` retries with a Range request); after a cancelled or failed pull, the complete files and
the partial one are kept and the next pull fetches only the rest. Nothing downloaded is ever
run: only safetensors / GGUF weights and tokenizer data files are fetched (never Python files or
pickled weights, never `trust_remote_code`), each file is checked against the hash the hub lists
for it, and a repository id must be `owner/name` (no paths). Before the first byte, the free disk
space and the memory the model will need are checked.
"""

import errno
import hashlib
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import DownloadCancelled, DownloadError
from .folders import converted_folder, hub_cache_dir
from .memory import shortfall
from .progress import DownloadProgress

# owner/name as the hub allows them: letters, digits, '-', '_', '.'; no '--' or '..'.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REPO_ID = re.compile(rf"{_PART}/{_PART}")
_GGUF_FILE = re.compile(r"(?:[A-Za-z0-9._-]+/)*[A-Za-z0-9._-]+\.gguf")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
# What an mlx-lm folder needs besides its safetensors weights: configuration and tokenizer data.
FOLDER_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                "chat_template.json", "chat_template.jinja",
                # a vision model's processor (engine/loading/vision.py)
                "preprocessor_config.json", "processor_config.json",
                "video_preprocessor_config.json")
PICKLED = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
PROGRESS_INTERVAL_S = 0.25
PROGRESS_BYTES = 2**20  # a report at least this often, whatever the time


@dataclass(frozen=True)
class PullSpec:
    repo: str
    file: str | None  # a GGUF file in the repository; None: an mlx-lm folder (or its one GGUF)

    @property
    def name(self) -> str:
        """The model's name once downloaded, as `list_models` shows it."""
        return f"{self.repo}:{self.file}" if self.file else self.repo


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None  # LFS files
    blob_id: str | None  # git's object id (sha1 of "blob <size>\0" + content) for the others


@dataclass(frozen=True)
class Plan:
    """What a pull will fetch: the repository's files at one commit."""

    spec: PullSpec
    revision: str
    files: tuple[RemoteFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def weights_bytes(self) -> int:
        return sum(f.size for f in self.files if f.name.endswith((".safetensors", ".gguf")))


def parse_spec(text: str) -> PullSpec:
    """`owner/name` or `owner/name:file.gguf`; raises DownloadError for anything else."""
    repo, _, file = text.strip().partition(":")
    if not _REPO_ID.fullmatch(repo) or "--" in repo or ".." in repo:
        raise DownloadError(f"{repo!r} is not a repository id: write it as owner/name, e.g. "
                            "HuggingFaceTB/SmolLM2-135M-Instruct")
    if file and (not _GGUF_FILE.fullmatch(file) or ".." in file.split("/")):
        raise DownloadError(f"{file!r} is not a GGUF file name in the repository: write "
                            "owner/name:FILE.gguf")
    return PullSpec(repo, file or None)


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def _hub_error(exc: Exception, spec: PullSpec) -> DownloadError:
    """A clear message for what huggingface_hub or the network raised."""
    from huggingface_hub import errors

    where = _endpoint() or "huggingface.co"
    if isinstance(exc, errors.GatedRepoError):
        return DownloadError(f"{spec.repo} is gated: accept its terms on its page at {where} and "
                             "set HF_TOKEN to a token of that account")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return DownloadError(f"no repository {spec.repo} at {where} (or it is private: set HF_TOKEN)")
    if isinstance(exc, errors.RevisionNotFoundError):
        return DownloadError(f"{spec.repo} has no such revision at {where}")
    if isinstance(exc, errors.EntryNotFoundError):
        return DownloadError(f"{spec.repo} has no file {spec.file or ''} at {where}")
    # huggingface_hub's HTTP client (httpx, or its fork httpx2) names its network errors so
    transport = any(c.__name__ == "TransportError" and c.__module__.startswith("httpx")
                    for c in type(exc).__mro__)
    if transport or isinstance(exc, (errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError)):
        return DownloadError(f"cannot reach {where}: check the network connection (offline?) and "
                             "try again")
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return DownloadError(f"the disk is full (or a file size limit was hit) while downloading "
                             f"{spec.name}; free some space and pull again")
    if isinstance(exc, errors.HfHubHTTPError):
        return DownloadError(f"the hub refused the download of {spec.name}: {exc}")
    return DownloadError(f"download of {spec.name} failed: {type(exc).__name__}: {exc}")


def _choose(spec: PullSpec, files: list[RemoteFile]) -> tuple[PullSpec, list[RemoteFile]]:
    """The files to fetch: the named GGUF, or an mlx-lm folder's safetensors and data files."""
    by_name = {f.name: f for f in files}
    ggufs = sorted(n for n in by_name if n.endswith(".gguf"))
    if spec.file is None and "config.json" not in by_name and ggufs:
        if len(ggufs) != 1:
            shown = ", ".join(ggufs[:8]) + (" …" if len(ggufs) > 8 else "")
            raise DownloadError(f"{spec.repo} holds several GGUF files ({shown}): pick one with "
                                f"{spec.repo}:FILE.gguf")
        spec = PullSpec(spec.repo, ggufs[0])
    if spec.file is not None:
        if spec.file not in by_name:
            raise DownloadError(f"{spec.repo} has no file {spec.file}"
                                + (f" (its GGUF files: {', '.join(ggufs[:8])})" if ggufs else ""))
        if _SPLIT_GGUF.search(spec.file):
            raise DownloadError(f"{spec.file} is one part of a split GGUF, which mlxchat cannot load")
        return spec, [by_name[spec.file]]
    if "config.json" not in by_name:
        raise DownloadError(f"{spec.repo} is neither an mlx-lm model folder (no config.json) nor "
                            "a repository of GGUF files")
    weights = [f for f in files if f.name.endswith(".safetensors") and "/" not in f.name]
    # a text-to-speech model's voice packs (engine/loading/speech.py)
    voices = [f for f in files if f.name.startswith("voices/") and f.name.endswith(".safetensors")
              and f.name.count("/") == 1]
    if not weights:
        pickled = [f.name for f in files if f.name.endswith(PICKLED)]
        raise DownloadError(f"{spec.repo} has no safetensors weights"
                            + (f" (only pickled ones: {', '.join(pickled[:4])}), which mlxchat "
                               "never loads because they can run code" if pickled else ""))
    return spec, [by_name[n] for n in FOLDER_FILES if n in by_name] + weights + voices


def plan(spec: PullSpec) -> Plan:
    """Ask the hub what `spec` is (one commit, its files with sizes and hashes)."""
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=_endpoint()).model_info(spec.repo, files_metadata=True)
    except Exception as exc:
        raise _hub_error(exc, spec) from exc
    files = []
    for s in info.siblings or []:
        if s.rfilename.startswith("/") or ".." in s.rfilename.split("/"):
            continue  # never a path outside the snapshot
        lfs = s.lfs
        files.append(RemoteFile(s.rfilename, int(s.size or (lfs.size if lfs else 0) or 0),
                                lfs.sha256 if lfs else None, s.blob_id))
    spec, chosen = _choose(spec, files)
    if not info.sha:
        raise DownloadError(f"the hub gave no commit for {spec.repo}")
    return Plan(spec, info.sha, tuple(chosen))


def _repo_dir(repo: str) -> Path:
    return hub_cache_dir() / f"models--{repo.replace('/', '--')}"


def _present_bytes(p: Plan) -> int:
    """Bytes of `p` already in the cache (complete blobs and partial downloads)."""
    blobs = _repo_dir(p.spec.repo) / "blobs"
    present = 0
    for f in p.files:
        for etag in filter(None, (f.sha256, f.blob_id)):
            for path in (blobs / etag, blobs / f"{etag}.incomplete"):
                if path.is_file():
                    present += path.stat().st_size
    return present


def check_room(p: Plan) -> None:
    """Refuse before downloading when the disk or the memory cannot take the model."""
    cache = hub_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    missing = max(0, p.total_bytes - _present_bytes(p))
    free = shutil.disk_usage(cache).free
    if missing > free:
        raise DownloadError(f"{p.spec.name} needs {missing / 1e9:.2f} GB more on the disk of "
                            f"{cache}, which has {free / 1e9:.2f} GB free")
    why = shortfall(p.spec.name, p.weights_bytes)
    if why:
        raise DownloadError(f"not downloading: {why}")


class _Tracker:
    """Counts the bytes of a pull as huggingface_hub reports them; checks for cancellation."""

    def __init__(self, total: int, progress: Callable[[DownloadProgress], None] | None,
                 cancel: threading.Event | None):
        self.total, self.progress, self.cancel = total, progress, cancel
        self.done = 0  # completed files and earlier sessions' bytes
        self.current = 0  # of the file in flight
        self.file = ""
        self.started = time.monotonic()
        self.start_bytes = 0  # bytes already there when this session began
        self.last_report = 0.0
        self.last_bytes = 0

    def begin_file(self, name: str, initial: int) -> None:
        self.file, self.current = name, initial
        self.report(force=True)

    def add(self, n: int) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise DownloadCancelled("download cancelled; pulling again fetches only the bytes still missing")
        self.current += n
        self.report()

    def end_file(self, size: int) -> None:
        self.done += size
        self.current = 0

    def snapshot(self, finished: bool = False) -> DownloadProgress:
        done = min(self.done + self.current, self.total)
        elapsed = time.monotonic() - self.started
        fetched = max(0, done - self.start_bytes)
        speed = fetched / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / speed if speed > 0 else None
        return DownloadProgress(done, self.total, speed, eta, self.file, finished)

    def report(self, force: bool = False) -> None:
        now, done = time.monotonic(), self.done + self.current
        if self.progress is not None and (force or now - self.last_report >= PROGRESS_INTERVAL_S
                                          or done - self.last_bytes >= PROGRESS_BYTES):
            self.last_report, self.last_bytes = now, done
            self.progress(self.snapshot())


def _bar_class(tracker: _Tracker, name: str) -> type:
    """A progress-bar class for huggingface_hub's `tqdm_class` that feeds `tracker`."""

    class Bar:
        def __init__(self, *args: Any, initial: int = 0, **kwargs: Any):
            if tracker.file != name:
                tracker.start_bytes += initial  # resumed: those bytes are not this session's speed
            tracker.begin_file(name, initial)

        def update(self, n: int | float | None = 1) -> None:
            tracker.add(int(n or 0))

        def close(self) -> None:
            pass

        def __enter__(self) -> "Bar":
            return self

        def __exit__(self, *exc: Any) -> None:
            pass

    return Bar


def _digest(path: Path, f: RemoteFile) -> tuple[str, str]:
    """(what the hub lists, what the file hashes to) for the file's kind of hash."""
    if f.sha256:
        h = hashlib.sha256()
        expected = f.sha256
    else:
        h = hashlib.sha1()
        h.update(f"blob {path.stat().st_size}\0".encode())
        expected = f.blob_id or ""
    with path.open("rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return expected.lower(), h.hexdigest()


def _fetch(p: Plan, f: RemoteFile, bar: type) -> Path:
    """One file into huggingface_hub's cache layout (`blobs/<etag>`, linked from
    `snapshots/<commit>/<name>`). The bytes go to `blobs/<etag>.incomplete` first, which stays when
    a pull is cancelled or fails: the next pull asks only for the rest (a Range request).
    huggingface_hub's own `hf_hub_download` deletes its partial file on any error."""
    from filelock import FileLock
    from huggingface_hub import hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    etag = f.sha256 or f.blob_id
    if not etag:
        raise DownloadError(f"the hub lists no hash for {f.name} of {p.spec.repo}")
    blob = _repo_dir(p.spec.repo) / "blobs" / etag
    blob.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{blob}.lock"):  # another pull of the same file (the CLI and the UI) waits
        if not blob.exists():
            partial = blob.with_name(f"{etag}.incomplete")
            with partial.open("ab") as out:
                if out.tell() > f.size:  # not a prefix of this file: start again
                    out.truncate(0)
                http_get(hf_hub_url(p.spec.repo, f.name, revision=p.revision, endpoint=_endpoint()),
                         out, resume_size=out.tell(), headers=build_hf_headers(),
                         expected_size=f.size or None, displayed_filename=f.name, tqdm_class=bar)
            os.replace(partial, blob)
    link = _repo_dir(p.spec.repo) / "snapshots" / p.revision / f.name
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.unlink(missing_ok=True)  # a dangling link to a deleted blob
        link.symlink_to(os.path.relpath(blob, link.parent))
    return link


def download(p: Plan, progress: Callable[[DownloadProgress], None] | None = None,
             cancel: threading.Event | None = None) -> Path:
    """Fetch `p`'s files (resuming partial ones) and check each against its hash; returns the
    snapshot folder (an mlx-lm folder) or the GGUF file."""
    check_room(p)
    tracker = _Tracker(p.total_bytes, progress, cancel)
    for f in p.files:
        if cancel is not None and cancel.is_set():
            raise DownloadCancelled("download cancelled; pulling again fetches only the bytes still missing")
        try:
            path = _fetch(p, f, _bar_class(tracker, f.name))
        except DownloadCancelled:
            raise
        except Exception as exc:
            raise _hub_error(exc, p.spec) from exc
        if tracker.file != f.name:  # already complete in the cache: no transfer reported
            tracker.start_bytes += f.size
        tracker.file = f.name
        expected, actual = _digest(path, f)
        if expected and actual != expected:
            blob = path.resolve()
            path.unlink(missing_ok=True)
            blob.unlink(missing_ok=True)
            raise DownloadError(f"{f.name} of {p.spec.repo} does not match the hub's hash "
                                f"({actual[:12]}… instead of {expected[:12]}…): deleted it")
        tracker.end_file(f.size)
    if progress is not None:
        progress(tracker.snapshot(finished=True))
    snapshot = _repo_dir(p.spec.repo) / "snapshots" / p.revision
    return snapshot / p.spec.file if p.spec.file else snapshot


def pull(text: str, progress: Callable[[DownloadProgress], None] | None = None,
         cancel: threading.Event | None = None) -> tuple[str, Path]:
    """Download `owner/name[:FILE.gguf]`; returns (the model's name, where it is)."""
    p = plan(parse_spec(text))
    return p.spec.name, download(p, progress, cancel)


def remove(name: str) -> list[Path]:
    """Delete a downloaded model (`owner/name` or `owner/name:FILE.gguf`) from the hub cache, with
    its converted copy; returns what was deleted. Only models in the hub cache can be removed, and
    only files inside it: a link pointing out of the cache is deleted, never its target."""
    spec = parse_spec(name)
    repo = _repo_dir(spec.repo)
    if not repo.is_dir():
        raise DownloadError(f"{name} is not a downloaded model")
    links = [link for link in (repo / "snapshots").glob(f"*/{spec.file}")] if spec.file else \
        [link for link in (repo / "snapshots").rglob("*.gguf")]
    if spec.file and not links:
        raise DownloadError(f"{name} is not a downloaded model")
    removed = _remove_converted(links)
    if spec.file:
        removed += _remove_links(repo, links)
        if any(p.is_file() for p in (repo / "snapshots").rglob("*")):
            return removed
    if repo.is_symlink():  # the repository folder itself links elsewhere: drop only the link
        repo.unlink()
    else:
        shutil.rmtree(repo)  # removes links inside, never what they point at
    removed.append(repo)
    return removed


def _remove_converted(ggufs: list[Path]) -> list[Path]:
    """Delete the mlx-lm folders converted from these GGUF files; returns those deleted."""
    removed = []
    for gguf in ggufs:
        folder = converted_folder(gguf) if gguf.exists() else None
        if folder is not None and folder.exists():
            shutil.rmtree(folder)
            removed.append(folder)
    return removed


def _remove_links(repo: Path, links: list[Path]) -> list[Path]:
    """Delete snapshot links and the blobs they point at inside the repository's cache."""
    blobs = (repo / "blobs").resolve()
    for link in links:
        blob = link.resolve()
        link.unlink()
        if blob.is_relative_to(blobs):  # a link out of the cache: its target is not ours
            blob.unlink(missing_ok=True)
    return list(links)
