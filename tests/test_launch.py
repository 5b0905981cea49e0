"""`mlxchat launch claude|codex`: the client runs with per-run settings pointed at a real mlxchat
(a tiny model on 127.0.0.1, with an API key), never touching the user's own configuration files.
The clients are stand-in executables that record their arguments and environment and, as the
real ones would, send one request where those settings point. (The real Claude Code and Codex
CLI: tests/test_launch_clients.py, opt-in.)"""

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from live_server import app_home, free_port, tiny_serving
from tiny_models import tiny_llama

pytestmark = pytest.mark.fast

KEY = "launch-key"
CONTEXT = 4096

# One stand-in for both clients (it knows which by its own name): it records what it was given,
# sends one request as the real client would with those settings, and exits STANDIN_EXIT.
STANDIN = textwrap.dedent('''\
    import json, os, sys, tomllib, urllib.request
    name, args, env = os.path.basename(sys.argv[0]), sys.argv[1:], os.environ
    record = {"argv": args, "env": {k: v for k, v in env.items()
                                    if k.startswith(("ANTHROPIC_", "CLAUDE_", "MLXCHAT_"))}}
    if name == "claude":
        url = env["ANTHROPIC_BASE_URL"] + "/v1/messages"
        token, model = env["ANTHROPIC_AUTH_TOKEN"], env["ANTHROPIC_MODEL"]
        body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    else:
        config = {}
        for flag, value in zip(args, args[1:]):
            if flag == "-c":
                key, _, raw = value.partition("=")
                config[key] = tomllib.loads("v = " + raw)["v"]
        url = config["model_providers.mlxchat.base_url"] + "/responses"
        key_env = config.get("model_providers.mlxchat.env_key")
        token, model = env.get(key_env, "") if key_env else "", config["model"]
        body = {"model": model, "max_output_tokens": 2, "input": "hi"}
        record["config"] = config
    request = urllib.request.Request(url, json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json", "Authorization": "Bearer " + token})
    try:
        record["status"] = urllib.request.urlopen(request, timeout=120).status
    except urllib.error.HTTPError as exc:
        record["status"] = exc.code
    with open(env["STANDIN_OUT"], "a") as out:
        out.write(json.dumps(record) + "\\n")
    sys.exit(int(env.get("STANDIN_EXIT", "0")))
''')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    lm = tiny_llama(max_position_embeddings=CONTEXT)
    with tiny_serving(tmp_path_factory.mktemp("launch"), lm, api_key=KEY) as s:
        yield s


@pytest.fixture
def home(tmp_path) -> Path:
    """A HOME with the user's own Claude Code and Codex settings in it."""
    home = tmp_path / "home"
    (home / ".claude").mkdir(parents=True)
    (home / ".claude" / "settings.json").write_text('{"model": "opus", "env": {"X": "1"}}\n')
    (home / ".claude.json").write_text('{"numStartups": 3}\n')
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text('model = "gpt-5"\n[model_providers.openai]\n'
                                                 'name = "OpenAI"\n')
    return home


def snapshot(home: Path) -> dict[str, tuple[bytes, float]]:
    return {str(p.relative_to(home)): (p.read_bytes(), p.stat().st_mtime)
            for p in sorted(home.rglob("*")) if p.is_file()}


@pytest.fixture
def bin_dir(tmp_path) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("claude", "codex"):
        path = folder / name
        path.write_text(f"#!{sys.executable}\n{STANDIN}")
        path.chmod(0o755)
    return folder


def launch(*args: str, home: Path, path: Path, out: Path, key: str | None = KEY,
           exit_code: int = 0):
    env = {"HOME": str(home), "PATH": str(path), "STANDIN_OUT": str(out),
           "STANDIN_EXIT": str(exit_code), "MLXCHAT_API_KEY": key}
    from app.cli.commands import cli

    return CliRunner().invoke(cli, ["launch", *args], env=env, prog_name="mlxchat")


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_claude_runs_against_mlxchat_with_per_run_settings(server, home, bin_dir, tmp_path):
    before = snapshot(home)
    out = tmp_path / "claude.jsonl"
    result = launch("claude", "--url", server.url, "--", "-p", "Say hello", home=home,
                    path=bin_dir, out=out)
    assert result.exit_code == 0, result.output
    (run,) = records(out)
    assert run["status"] == 200  # the settings point at a server that answers
    assert run["argv"] == ["--bare", "-p", "Say hello"]  # lean: a 4,096-token context
    env = run["env"]
    assert env["ANTHROPIC_BASE_URL"] == server.url and env["ANTHROPIC_AUTH_TOKEN"] == KEY
    assert env["ANTHROPIC_API_KEY"] == ""
    assert {env[slot] for slot in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                                   "ANTHROPIC_DEFAULT_HAIKU_MODEL")} == {server.model}
    assert "ANTHROPIC_DEFAULT_OPUS_MODEL" not in env  # Claude Code rewrites "opus" settings
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert snapshot(home) == before  # the user's own files, byte for byte and untouched
    # what it set is printed (the key itself is not)
    assert "ANTHROPIC_BASE_URL=" in result.stderr and "CLAUDE_CODE_ATTRIBUTION_HEADER=0" in \
        result.stderr and KEY not in result.stderr


def test_codex_gets_a_responses_provider_and_the_context_window(server, home, bin_dir, tmp_path):
    before = snapshot(home)
    out = tmp_path / "codex.jsonl"
    result = launch("codex", "--url", server.url, "--full", "--", "exec", "Say hello",
                    home=home, path=bin_dir, out=out)
    assert result.exit_code == 0, result.output
    (run,) = records(out)
    assert run["status"] == 200
    assert run["argv"][-2:] == ["exec", "Say hello"]
    assert run["config"] == {
        "model_provider": "mlxchat", "model": server.model,
        "model_providers.mlxchat.name": "mlxchat",
        "model_providers.mlxchat.base_url": f"{server.url}/v1",
        "model_providers.mlxchat.wire_api": "responses",
        "model_providers.mlxchat.env_key": "MLXCHAT_API_KEY",
        "model_context_window": CONTEXT, "model_auto_compact_token_limit": int(CONTEXT * 0.8)}
    assert run["env"]["MLXCHAT_API_KEY"] == KEY
    assert snapshot(home) == before


def test_lean_codex_on_a_small_context(server, home, bin_dir, tmp_path):
    out = tmp_path / "codex.jsonl"
    result = launch("codex", "--url", server.url, "--", "exec", "hi", home=home, path=bin_dir,
                    out=out)
    assert result.exit_code == 0, result.output
    config = records(out)[0]["config"]
    assert config["features.multi_agent"] is False and config["web_search"] == "disabled"
    assert "lean" in result.stderr


def test_the_clients_exit_status_is_launchs(server, home, bin_dir, tmp_path):
    result = launch("claude", "--url", server.url, "--", "-p", "x", home=home, path=bin_dir,
                    out=tmp_path / "o.jsonl", exit_code=3)
    assert result.exit_code == 3


def test_a_missing_client_says_how_to_install_it(server, home, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = launch("codex", "--url", server.url, home=home, path=empty, out=tmp_path / "o")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == \
        "Error: Codex CLI is not installed: npm install -g @openai/codex"


def test_a_server_with_a_key_needs_it(server, home, bin_dir, tmp_path):
    result = launch("claude", "--url", server.url, home=home, path=bin_dir,
                    out=tmp_path / "o", key=None)
    assert result.exit_code == 1 and "needs its API key" in result.stderr


@pytest.mark.slow  # starts `mlxchat serve` in a child process: seconds of imports and a load
def test_launch_starts_mlxchat_when_none_runs_and_stops_it(home, bin_dir, tmp_path):
    """No server at the URL: launch starts one on the chosen model, runs the client against it,
    and stops it when the client exits."""
    import subprocess

    import httpx

    model = str(tiny_llama(max_position_embeddings=CONTEXT).path)
    url = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "claude.jsonl"
    env = {**os.environ, "HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "STANDIN_OUT": str(out), "MLXCHAT_HOME": str(app_home(tmp_path / "mlxchat"))}
    env.pop("MLXCHAT_API_KEY", None)
    done = subprocess.run([sys.executable, "-m", "app.cli", "launch", "claude", "--url", url,
                           "--model", model, "--", "-p", "hi"], env=env, capture_output=True,
                          text=True, timeout=280, stdin=subprocess.DEVNULL,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert records(out)[0]["status"] == 200
    assert "Starting mlxchat" in done.stderr and "Stopping" in done.stderr
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)
