"""The programmatic APIs, each an adapter over one serving core (app/api/serving.py, whose
docstring is the contract an adapter follows):

- `chat.py`: OpenAI `/v1/chat/completions`; `completions.py`: legacy `/v1/completions`;
  `openai_request.py`, `response_format.py`, `tool_messages.py`: the OpenAI request parts they
  share; `choices.py`: OpenAI's message/delta shapes of the choices.
- `anthropic.py`: Anthropic Messages `/v1/messages`; `responses.py`: OpenAI Responses
  `/v1/responses`; `ollama.py`: Ollama's `/api/*`.
- `embeddings.py`: OpenAI `/v1/embeddings` (and the `embed` Ollama's `/api/embed` shares).
- `audio.py`: OpenAI `/v1/audio/transcriptions`, `/translations` and `/speech` (voice).
- `infill.py`: llama.cpp's `/infill` (fill-in-the-middle); `rerank.py`: `/v1/rerank` (Jina/Cohere,
  and llama.cpp's `/rerank` paths).
- `models.py`: `/v1/models` and the model a request runs on; `health.py`: `/health` and
  `/metrics`.
- `errors.py`: `ApiError` (written in each protocol's shape, app/api/error_shapes.py).
"""

from . import (anthropic, audio, chat, completions, embeddings, health, infill, models, ollama,
               rerank, responses)

routes = [*health.routes, *models.routes, *chat.routes, *completions.routes, *anthropic.routes,
          *ollama.routes, *responses.routes, *embeddings.routes,
          *infill.routes, *rerank.routes, *audio.routes]
