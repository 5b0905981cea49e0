"""Images inside tool results, as Claude Code's Read and Codex's view_image return them, on a
real server (127.0.0.1) running a tiny random-weight Qwen2.5-VL: answered through the vision
path, the image's tokens counted, and a document beside them read as text. (On a text model the
same request is a 400 naming the vision models: tests/test_agent_requests.py.)"""

import base64
import io

import httpx
import pytest

pytest.importorskip("mlx_vlm")

from bench.document_corpus import pdf_of_pages  # noqa: E402
from bench.vlm_shapes import random_image, tiny_qwen2_5_vl  # noqa: E402
from engine import ImageInput, count_tokens  # noqa: E402
from live_server import engine_serving  # noqa: E402

pytestmark = pytest.mark.fast

READ = {"name": "Read", "description": "Read a file.",
        "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}


def png(seed: int) -> str:
    out = io.BytesIO()
    random_image(seed, (56, 56)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def lm():
    return tiny_qwen2_5_vl()


@pytest.fixture(scope="module")
def server(lm, tmp_path_factory):
    with engine_serving(tmp_path_factory.mktemp("agent-vision"), lm=lm) as s:
        yield s


def test_an_image_and_a_pdf_inside_a_claude_code_tool_result(server):
    notes = base64.b64encode(pdf_of_pages([["Gauge recalibrated in March."]])).decode()
    body = {"model": "claude-opus-5-5", "max_tokens": 3, "tools": [READ], "messages": [
        {"role": "user", "content": "Look at the diagram and the notes."},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "d.png"}},
            {"type": "tool_use", "id": "t2", "name": "Read", "input": {"file_path": "n.pdf"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": png(3)}}]},
            {"type": "tool_result", "tool_use_id": "t2", "content": [
                {"type": "text", "text": "PDF file read"},
                {"type": "document", "source": {"type": "base64",
                                                "media_type": "application/pdf",
                                                "data": notes}}]}]}]}
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    # the image's tokens are in the prompt: as many more as the same image in a user turn adds
    engine, text = server.app.state.engine, {"type": "text", "text": "x"}
    image = {"type": "image", "image": ImageInput.from_pil(random_image(3, (56, 56)))}
    with_image = count_tokens(engine, messages=[{"role": "user", "content": [image, text]}])
    without = count_tokens(engine, messages=[{"role": "user", "content": [text]}])
    assert prompt > with_image - without > 4
    counted = httpx.post(f"{server.url}/v1/messages/count_tokens", json=body, timeout=120).json()
    assert counted["input_tokens"] == prompt


def test_an_image_in_a_codex_function_call_output(server):
    def ask(output):
        r = httpx.post(f"{server.url}/v1/responses", timeout=120, json={
            "model": "gpt-5", "max_output_tokens": 3, "store": False, "input": [
                {"role": "user", "content": "What does the diagram show?"},
                {"type": "function_call", "call_id": "c1", "name": "view_image",
                 "arguments": '{"path": "d.png"}'},
                {"type": "function_call_output", "call_id": "c1", "output": output}]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens"]

    url = "data:image/png;base64," + png(4)
    shown = ask([{"type": "input_image", "image_url": url, "detail": "high"}])
    assert shown > ask([{"type": "input_text", "text": ""}]) + 4  # the image's tokens
