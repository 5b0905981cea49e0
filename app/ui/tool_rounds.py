"""A turn's MCP tool rounds on the page (app/mcp/rounds.py's `RoundsView`): notices while servers
start and calls run, the answer that called with its calls, and the approval question, sent to
every page of the conversation."""

import dataclasses
import json

from ..mcp.approval import Question
from ..storage import Conversation, Message, Storage
from .conversation_pages import ConversationPages
from .views import message_views, render


def question_html(question: Question | None) -> str:
    """The approval question (`_tool_approval.html`), or the empty box that replaces it."""
    if question is None:
        return render("_tool_approval.html", call=None)
    return render("_tool_approval.html", call=question.call, tool=question.tool,
                  arguments=json.dumps(question.arguments, indent=2, ensure_ascii=False))


@dataclasses.dataclass
class RoundsPages:
    """The tool rounds of a turn in conversation `cid`, on every page that shows it."""

    pages: ConversationPages
    storage: Storage
    cid: int

    async def notice(self, text: str) -> None:
        await self.pages.send(self.cid, render("_notice.html", text=text))

    async def calls(self, conv: Conversation, path: list[Message]) -> None:
        view = dataclasses.replace(message_views(self.storage, path)[-1], regenerable=False)
        await self.pages.send(self.cid, render("_message.html", conv=conv, v=view, oob=True))

    async def question(self, question: Question | None) -> None:
        await self.pages.send(self.cid, question_html(question))
