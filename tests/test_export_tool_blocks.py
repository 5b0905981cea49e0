"""Imported tool calls and tool results in the conversation view: collapsible blocks whose text
(the function's name, its arguments, the tool's output) is escaped, whatever it holds, and which
reach the model as OpenAI messages again."""

import pytest

from app.ui.prompt import engine_messages
from app.storage import import_conversation
from app.ui.views import message_views

pytestmark = pytest.mark.fast

HOSTILE = '<script>alert(1)</script><img src=x onerror="alert(2)">'


def imported(storage):
    call = {"id": "call_<1>", "type": "function",
            "function": {"name": f"lookup{HOSTILE}", "arguments": '{"q": "' + HOSTILE.replace('"', "'") + '"}'}}
    return import_conversation(storage, {"messages": [
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_<1>", "content": HOSTILE},
        {"role": "assistant", "content": "Done."}]}), call


def test_tool_calls_and_results_render_as_escaped_collapsible_blocks(storage):
    conv, _ = imported(storage)
    views = message_views(storage, storage.active_path(conv.id))
    call_html, result_html = views[1].html, views[2].html
    assert call_html.count('<details class="tool-call">') == 1
    assert result_html.startswith('<details class="tool-result">')
    for fragment in (call_html, result_html):
        assert "<script" not in fragment and "<img" not in fragment
        assert "&lt;script&gt;" in fragment
    assert "Tool call: <code>lookup&lt;script&gt;" in call_html
    assert '"q":' in call_html.replace("&quot;", '"')  # arguments shown as indented JSON
    assert "call_&lt;1&gt;" in result_html


def test_tool_turns_reach_the_model_as_openai_messages(storage):
    conv, call = imported(storage)
    messages = engine_messages({}, storage.active_path(conv.id))
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert messages[2] == {"role": "tool", "content": HOSTILE, "tool_call_id": "call_<1>"}
