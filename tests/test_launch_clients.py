"""The real Claude Code and Codex CLI (from npm), run by `mlxchat launch` against `mlxchat serve`
on the bundled model: each answers "Say hello" and exits 0, and the user's own settings files are
the same afterwards.

Opt-in (they need npm's packages and a minute or two): `scripts/install-agent-clients`, then
`pytest -m agent_clients tests/test_launch_clients.py`. scripts/test skips them; so does any run
whose `-m` does not name `agent_clients`. The clients are found in $MLXCHAT_AGENT_CLIENTS (or
~/.cache/mlxchat/agent-clients) as the script installs them, else on PATH."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from live_server import ServerProcess

pytestmark = pytest.mark.agent_clients

REPO = Path(__file__).resolve().parents[1]
INSTALLED = Path(os.environ.get("MLXCHAT_AGENT_CLIENTS",
                                Path.home() / ".cache" / "mlxchat" / "agent-clients"))
BIN = INSTALLED / "node_modules" / ".bin"


@pytest.fixture(scope="module", autouse=True)
def opted_in(request):
    if "agent_clients" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in: pytest -m agent_clients (after scripts/install-agent-clients)")


def path_with_clients() -> str:
    path = f"{BIN}:{os.environ['PATH']}"
    for name in ("claude", "codex"):
        if shutil.which(name, path=path) is None:
            pytest.skip(f"{name} is not installed: scripts/install-agent-clients")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("clients")).start()
    yield s
    s.stop()


@pytest.fixture
def workdir(tmp_path) -> tuple[Path, Path]:
    """(a git repository to work in, a HOME with the user's own settings in it)."""
    home, repo = tmp_path / "home", tmp_path / "repo"
    (home / ".claude").mkdir(parents=True)
    (home / ".claude" / "settings.json").write_text('{"model": "opus"}\n')
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text('model = "gpt-5"\n')
    repo.mkdir()
    (repo / "README.md").write_text("# tides\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    return repo, home


SETTINGS = (".claude/settings.json", ".codex/config.toml")


@pytest.mark.parametrize("client,args", [("claude", ["-p", "Say hello"]),
                                         ("codex", ["exec", "Say hello"])])
def test_the_real_client_says_hello_through_launch(server, workdir, client, args):
    repo, home = workdir
    before = {name: (home / name).read_bytes() for name in SETTINGS}
    env = {**os.environ, "HOME": str(home), "PATH": path_with_clients(),
           "PYTHONPATH": str(REPO)}
    env.pop("MLXCHAT_API_KEY", None)
    env.pop("ANTHROPIC_API_KEY", None)
    done = subprocess.run([sys.executable, "-m", "app.cli", "launch", client, "--url", server.url,
                           "--", *args], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=280, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip(), done.stderr  # the model's answer
    assert {name: (home / name).read_bytes() for name in SETTINGS} == before
