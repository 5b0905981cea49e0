"""Downloads (`mlxchat pull`) against a local stand-in of the hub's HTTP API serving a tiny
random-weight mlx-lm repository: progress, resume, hashes, refusals, removal."""

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine import DownloadCancelled, DownloadError, list_models, parse_pull_spec, pull_model, remove_model
from hub_standin import HubStandIn, Repo
from live_server import REPO, ThreadedServer, free_port
from tiny_models import LLAMA, build_folder

pytestmark = pytest.mark.fast

GENERATION_CONFIG = {"temperature": 0.6, "top_p": 0.95, "top_k": 40, "bos_token_id": 1}


@pytest.fixture(scope="module")
def tiny_files() -> dict[str, bytes]:
    folder = build_folder(LLAMA, seed=0)
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    files["generation_config.json"] = json.dumps(GENERATION_CONFIG).encode()
    files["README.md"] = b"# tiny\n"
    files["modeling_tiny.py"] = b"import os; os.system('echo never run')\n"
    return files


@pytest.fixture
def hub(tiny_files, tmp_path, monkeypatch):
    standin = HubStandIn({
        "test/tiny": Repo(dict(tiny_files)),
        "test/ggufs": Repo({"a.Q4_0.gguf": b"GGUF" + os.urandom(5000),
                            "b.Q8_0.gguf": b"GGUF" + os.urandom(7000), "README.md": b"hi"}),
        "test/gated": Repo(dict(tiny_files), gated=True),
        "test/huge": Repo(dict(tiny_files), declared_sizes={"model.safetensors": 10**16}),
        "test/corrupt": Repo(dict(tiny_files), corrupt={"model.safetensors"}),
        "test/pickled": Repo({"config.json": tiny_files["config.json"],
                              "pytorch_model.bin": b"\x80\x04pickle"}),
    })
    server = ThreadedServer(standin.app).start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    yield standin
    server.stop()


def _range_start(header: str) -> int:
    return int(header.removeprefix("bytes=").split("-")[0])


def _gets(standin: HubStandIn, file: str) -> list[str | None]:
    """The Range headers of the GET requests for `file`."""
    return [rng for method, path, rng in standin.log if method == "GET" and path.endswith("/" + file)]


def test_pull_fetches_weights_and_data_only_with_progress(hub, tiny_files, tmp_path):
    events = []
    name, folder = pull_model("test/tiny", progress=events.append)
    assert name == "test/tiny"
    fetched = sorted(p.name for p in folder.iterdir())
    assert fetched == ["config.json", "generation_config.json", "model.safetensors",
                       "tokenizer.json", "tokenizer_config.json"]  # no code, no README
    for f in fetched:
        assert (folder / f).read_bytes() == tiny_files[f]
    total = sum(len(tiny_files[f]) for f in fetched)
    assert events[-1].finished and events[-1].done_bytes == events[-1].total_bytes == total
    done = [e.done_bytes for e in events]
    assert done == sorted(done) and len(set(done)) > 2  # it moved, in steps
    assert any(e.speed > 0 and e.eta_s is not None for e in events[:-1])
    assert {e.file for e in events} >= {"model.safetensors", "tokenizer.json"}
    listed = {m.name: m for m in list_models()}
    assert listed["test/tiny"].source == "hf-cache" and Path(listed["test/tiny"].path) == folder
    assert Path(folder).is_relative_to(tmp_path / "hub" / "models--test--tiny")


def test_interrupted_transfer_resumes_from_where_it_stopped(hub, tiny_files):
    hub.break_after["model.safetensors"] = 20 * 2**20  # the connection drops after 20 MiB
    _, folder = pull_model("test/tiny")
    ranges = _gets(hub, "model.safetensors")
    assert ranges[0] is None and len(ranges) == 2
    assert 0 < _range_start(ranges[1]) <= 20 * 2**20  # only the rest came again
    assert (folder / "model.safetensors").read_bytes() == tiny_files["model.safetensors"]


def test_cancelled_pull_resumes_from_its_partial_file(hub, tiny_files):
    cancel = threading.Event()
    others = sum(len(data) for name, data in tiny_files.items() if name != "model.safetensors")

    def progress(p):
        if p.file == "model.safetensors" and p.done_bytes > others + 2**20:
            cancel.set()

    with pytest.raises(DownloadCancelled):
        pull_model("test/tiny", progress=progress, cancel=cancel)
    assert "test/tiny" not in {m.name for m in list_models()}
    events = []
    _, folder = pull_model("test/tiny", progress=events.append)
    assert len(_gets(hub, "tokenizer.json")) == 1  # complete before the cancel: not fetched again
    first, second = _gets(hub, "model.safetensors")
    assert first is None and _range_start(second) > 2**20  # the partial file's bytes were kept
    assert (folder / "model.safetensors").read_bytes() == tiny_files["model.safetensors"]
    assert events[-1].done_bytes == events[-1].total_bytes


def test_one_gguf_file_of_a_repository(hub):
    name, path = pull_model("test/ggufs:b.Q8_0.gguf")
    assert name == "test/ggufs:b.Q8_0.gguf" and path.name == "b.Q8_0.gguf" and path.is_file()
    assert not any("a.Q4_0.gguf" in p for _, p, _ in hub.log if "/resolve/" in p)
    assert {m.name for m in list_models()} >= {"test/ggufs:b.Q8_0.gguf"}
    with pytest.raises(DownloadError, match="several GGUF files.*test/ggufs:FILE.gguf"):
        pull_model("test/ggufs")
    with pytest.raises(DownloadError, match="has no file c.gguf"):
        pull_model("test/ggufs:c.gguf")
    remove_model("test/ggufs:b.Q8_0.gguf")
    assert "test/ggufs:b.Q8_0.gguf" not in {m.name for m in list_models()}


def test_missing_and_gated_repositories_are_named_clearly(hub):
    with pytest.raises(DownloadError, match="no repository test/missing at http://127.0.0.1"):
        pull_model("test/missing")
    with pytest.raises(DownloadError, match="test/gated is gated: accept its terms"):
        pull_model("test/gated")


def test_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(DownloadError, match="cannot reach .*offline"):
        pull_model("test/tiny")


def test_not_enough_disk_is_refused_before_any_byte(hub):
    with pytest.raises(DownloadError, match="needs .* GB more on the disk"):
        pull_model("test/huge")
    assert not any("/resolve/" in path for _, path, _ in hub.log)


@pytest.mark.slow  # the real CLI in a child process: the second tier
def test_a_full_disk_mid_transfer_is_a_clear_error(hub, tiny_files):
    """The disk fills up (a file size limit of 1 MB) while `mlxchat pull` writes."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "app.cli", "pull", "test/tiny"], cwd=REPO,
                            env=env, preexec_fn=limit, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "the disk is full" in result.stderr and "free some space and pull again" in result.stderr
    before = len(hub.log)
    _, folder = pull_model("test/tiny")  # room again: the file that filled the disk resumes
    resumed = [rng for method, _, rng in hub.log[before:] if method == "GET" and rng]
    assert resumed and 0 < _range_start(resumed[0]) <= 2**20
    assert (folder / "model.safetensors").read_bytes() == tiny_files["model.safetensors"]


def test_a_file_that_does_not_match_its_hash_is_deleted(hub):
    with pytest.raises(DownloadError, match="model.safetensors of test/corrupt does not match"):
        pull_model("test/corrupt")
    blobs = Path(os.environ["HF_HUB_CACHE"]) / "models--test--corrupt" / "blobs"
    expected = hashlib.sha256(hub.repos["test/corrupt"].files["model.safetensors"]).hexdigest()
    assert not (blobs / expected).exists()
    assert "test/corrupt" not in {m.name for m in list_models()}


def test_pickled_weights_are_never_downloaded(hub):
    with pytest.raises(DownloadError, match="no safetensors weights .*pickled"):
        pull_model("test/pickled")
    assert not any("/resolve/" in path for _, path, _ in hub.log)


@pytest.mark.parametrize("spec", ["../etc", "a/b/c", "a/../b", "a--b/c", "a/b:../../x.gguf",
                                  "a/b:x.bin", "/abs/path", "a/b:/x.gguf", "a/.b"])
def test_repository_ids_are_validated(spec):
    with pytest.raises(DownloadError):
        parse_pull_spec(spec)


def test_remove_deletes_a_downloaded_model(hub):
    pull_model("test/tiny")
    repo_dir = Path(os.environ["HF_HUB_CACHE"]) / "models--test--tiny"
    assert repo_dir.is_dir()
    remove_model("test/tiny")
    assert not repo_dir.exists() and "test/tiny" not in {m.name for m in list_models()}
    with pytest.raises(DownloadError, match="not a downloaded model"):
        remove_model("test/tiny")


def test_the_model_picker_downloads_with_progress_and_deletes(hub, tmp_path):
    import httpx

    from engine import Engine
    from live_server import serving

    folder = build_folder(LLAMA, seed=0)
    engine = Engine(str(folder)).start()
    hub.pace_s = 0.15  # the download spans several of the page's progress polls
    with serving(engine, tmp_path / "db.sqlite") as server:
        http = httpx.Client(base_url=server.url, timeout=60)
        r = http.post("/models/download", data={"spec": "test/tiny"})
        assert r.status_code == 200 and 'sse-connect="/models/download/progress"' in r.text
        progress, done = [], ""
        with http.stream("GET", "/models/download/progress") as events:
            kind, data = None, []
            for line in events.iter_lines():
                if line.startswith("event: "):
                    kind, data = line[7:], []
                elif line.startswith("data: "):
                    data.append(line[6:])
                elif not line and kind == "progress":  # one event: the progress element
                    progress.append("\n".join(data))
                elif not line and kind == "done":
                    done = "\n".join(data)
                    break
        assert progress and all('<p class="progress-text">Downloading test/tiny' in p
                                for p in progress)
        assert any('<progress max="1" value="' in p for p in progress)  # the bar, once sized
        assert "Downloaded test/tiny." in done and ">test/tiny<" in done
        assert 'hx-confirm="Delete test/tiny' in done  # deleting asks first
        r = http.post("/models/delete", data={"name": "test/tiny"})
        assert "Deleted test/tiny." in r.text and ">test/tiny<" not in r.text
        r = http.post("/models/download/cancel")  # Settings › Model again, nothing running
        assert r.status_code == 200 and 'id="model-settings"' in r.text
        assert "Deleted test/tiny." not in r.text  # a notice shows once
        r = http.post("/models/download", data={"spec": "test/missing"})
        with http.stream("GET", "/models/download/progress") as events:
            text = "".join(events.iter_lines())
        assert "no repository test/missing" in text
        assert 'value="test/missing"' in text  # what was typed stays, to correct it


def test_remove_never_follows_a_link_out_of_the_cache(hub, tmp_path):
    """A snapshot entry pointing outside the hub cache (a link someone planted) is unlinked, and
    its target left alone."""
    _, path = pull_model("test/ggufs:b.Q8_0.gguf")
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    path.unlink()
    path.symlink_to(outside)
    remove_model("test/ggufs:b.Q8_0.gguf")
    assert outside.read_text() == "keep me"
    assert not path.is_symlink()
