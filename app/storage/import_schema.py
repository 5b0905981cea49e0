"""What an imported conversation may hold, as pydantic models: every field of an upload is
validated into our own types before anything is stored, so a wrong type, a non-finite number or a
far-future time is a clear error naming the field (the import answers 400), never a stored row
that breaks a page later. `export_conversation` (export_import.py) writes this shape."""

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine import MESSAGE_ROLES, SamplingParams, SpeculativeOptions

from .records import MESSAGE_STATES

MAX_MESSAGES = 100_000
MAX_TITLE_CHARS = 1_000
FUTURE_SLACK_S = 86_400  # clocks differ; a time further ahead than this is refused


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


def _time(value: float | None) -> float | None:
    if value is not None and not (0 <= value <= time.time() + FUTURE_SLACK_S):
        raise ValueError("must be a time (seconds since 1970) not in the future")
    return value


Time = Annotated[float | None, AfterValidator(_time)]


class Attachment(_Strict):
    name: str
    text: str
    tokens: int = Field(ge=0)


class Draft(_Strict):
    content: str = ""
    attachments: list[Attachment] = []


class Settings(BaseModel):
    """A conversation's settings: the keys pages read are typed; others are kept as they are."""

    model_config = ConfigDict(extra="allow", strict=True)

    system_prompt: str | None = None
    truncate: Literal["oldest"] | None = None
    draft: Draft | None = None
    sampling: dict[str, Any] | None = None
    speculative: dict[str, Any] | None = None

    @field_validator("sampling")
    @classmethod
    def _sampling(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            try:
                SamplingParams(**value)
            except Exception as exc:  # a TypeError for an unknown name, InvalidRequest for a value
                raise ValueError(f"not sampling settings ({exc})") from None
        return value

    @field_validator("speculative")
    @classmethod
    def _speculative(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            try:
                SpeculativeOptions(**value)
            except Exception as exc:
                raise ValueError(f"not speculative settings ({exc})") from None
        return value


class ImportedMessage(_Strict):
    id: int | None = None
    parent: int | None = None
    role: Literal[MESSAGE_ROLES]
    content: str | None = None
    model: str | None = None
    sampling: dict[str, Any] | None = None
    ttft_ms: float | None = Field(default=None, ge=0)
    tokens_per_s: float | None = Field(default=None, ge=0)
    prompt_tokens: int | None = Field(default=None, ge=0)
    completion_tokens: int | None = Field(default=None, ge=0)
    cached_tokens: int | None = Field(default=None, ge=0)
    finish_reason: str | None = None
    state: Literal[MESSAGE_STATES] | None = None
    error: str | None = None
    created: Time = None
    speculative: dict[str, Any] | None = None
    attachments: list[Attachment] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    tool_meta: dict[str, Any] | None = None  # MCP: a call's server and outcome


class ImportedConversation(_Strict):
    title: str | None = Field(default=None, max_length=MAX_TITLE_CHARS)
    created: Time = None
    updated: Time = None
    model: str | None = None
    settings: Settings | None = None
    leaf: int | None = None
    messages: list[ImportedMessage] = Field(max_length=MAX_MESSAGES)


def validated(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (our export format) as our types, back as plain JSON values; ValueError naming the
    first bad field."""
    try:
        conv = ImportedConversation.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the file"
        raise ValueError(f"{where}: {first['msg']}") from None
    out = conv.model_dump(exclude={"messages", "settings"})
    out["settings"] = conv.settings.model_dump(exclude_unset=True) if conv.settings else {}  # as sent
    out["messages"] = [m.model_dump() for m in conv.messages]
    return out


def validated_message(i: int, data: Any) -> dict[str, Any]:
    """One message of a plain OpenAI `messages` list as our types; ValueError naming the field."""
    try:
        return ImportedMessage.model_validate(data).model_dump()
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"messages[{i}].{'.'.join(str(p) for p in first['loc'])}: "
                         f"{first['msg']}") from None
