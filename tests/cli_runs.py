"""The real `mlxchat` command line in a child process (or, for what click itself checks, in this
one), and reading the one line it refuses with."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def mlxchat(*args: str, home: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """`mlxchat ARGS...` with MLXCHAT_HOME=`home`, no standard input; its output captured."""
    env = {**os.environ, "MLXCHAT_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def mlxchat_options(*args: str, home: Path) -> subprocess.CompletedProcess:
    """`mlxchat ARGS...` in this process, through click's own test runner: for what click answers
    while it parses the options (`--help`, a value out of range), before any code of ours runs,
    so nothing differs from a child process but the ~2 s a child spends importing mlx-lm and
    transformers. Refusals our code raises (`SystemExit` turned into an `Error:` line by
    `app.cli.commands.main`) and the program name `main` gives need `mlxchat` and a child process."""
    from click.testing import CliRunner

    from app.cli.commands import cli

    result = CliRunner().invoke(cli, list(args), prog_name="mlxchat",
                                env={"MLXCHAT_HOME": str(home)})
    return subprocess.CompletedProcess(["mlxchat", *args], result.exit_code, result.stdout,
                                       result.stderr)


def refusal(result: subprocess.CompletedProcess) -> str:
    """The one line the CLI said, checking it said nothing else of note."""
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [l for l in result.stderr.splitlines() if l.strip() and "no GPU" not in l
             and not l.startswith("Usage:") and not l.startswith("Try ")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    return lines[0]
