"""Voice in the page: what the microphone and read-aloud buttons need from the server.

- `GET /voice`: which speech models are installed (the first of each kind serves the page) and,
  for a kind with none, the `mlxchat pull ...` line that installs one; the page asks once and the
  buttons say it.
- `GET /c/{cid}/m/{mid}/speech`: an answer read aloud, streamed as MP3 while it is made (the
  page's `<audio>` element plays it as it comes). The text is the answer's prose: reasoning
  (`<think>`), code blocks and Markdown syntax are not read.

The microphone posts the recording (WebM/Opus from MediaRecorder) to `/v1/audio/transcriptions`
itself, as any client does (app/api/audio.py); the transcript goes into the composer for the user
to edit and send (static/app.js).
"""

from __future__ import annotations

import asyncio
import re

from markdown_it import MarkdownIt
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import SPEECH_MAX_TEXT, SPEECH_SUGGESTED

from ..api.audio import encoded, first_wave, start_speech
from ..api.errors import ApiError
from ..api.audio_codec import Encoder
from ..state import app_state

_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
_SKIPPED = {"fence", "code_block", "html_block"}
_md = MarkdownIt("commonmark").enable("table")


def speakable(markdown: str) -> str:
    """The words of an answer to read aloud: its paragraphs, headings, list items and table
    cells as plain text, one per line; reasoning, code blocks and raw HTML left out; at most
    SPEECH_MAX_TEXT characters (a long answer's first sentences)."""
    lines = []
    for token in _md.parse(_THINK.sub("", markdown)):
        if token.type in _SKIPPED or token.type != "inline":
            continue
        text = "".join(child.content for child in token.children or []
                       if child.type in ("text", "code_inline"))
        if text.strip():
            lines.append(text.strip())
    text = "\n".join(lines)
    if len(text) > SPEECH_MAX_TEXT:  # the first sentences, as many as one request reads
        cut = max(text.rfind(end, 0, SPEECH_MAX_TEXT) for end in (". ", "\n", "? ", "! "))
        text = text[:cut + 1 if cut > 0 else SPEECH_MAX_TEXT]
    return text


async def voice_status(request: Request) -> Response:
    engine = app_state(request).engine
    status = {}
    for kind in ("transcription", "speech"):
        models = await asyncio.to_thread(engine.speech_models, kind)
        status[kind] = {"model": models[0] if models else None,
                        "pull": None if models else f"mlxchat pull {SPEECH_SUGGESTED[kind]}"}
    return JSONResponse(status)


async def read_aloud(request: Request) -> Response:
    state = app_state(request)
    storage = state.storage
    cid, mid = request.path_params["cid"], request.path_params["mid"]
    try:
        message = await asyncio.to_thread(storage.get_message, mid)
        if message is None or message.conversation_id != cid or message.role != "assistant":
            raise ApiError(404, "no such answer in this conversation", code="not_found")
        text = speakable(message.content)
        if not text:
            raise ApiError(400, "this answer has no words to read aloud", code="empty_input")
        stream = await start_speech(state.engine, text, model=None, voice=None,
                                    speed=1.0)
        waves = await first_wave(stream)
    except ApiError as err:
        return err.response(request.url.path)
    encoder = Encoder("mp3", stream.sample_rate)
    return StreamingResponse(encoded(waves, encoder), media_type=encoder.content_type,
                             headers={"Cache-Control": "no-store"})


routes = [Route("/voice", voice_status), Route("/c/{cid:int}/m/{mid:int}/speech", read_aloud)]
