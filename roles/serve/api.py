"""The requests the endpoint accepts (pydantic, validated once at the edge) and OpenAI's error format.

Responses are the `openai` package's own models (`ChatCompletion`, `ChatCompletionChunk`,
`Completion`): what the official client parses is what we send.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

__all__ = ["ChatRequest", "CompletionRequest", "RewardRequest", "ApiError", "error_response", "parse"]

_Tokens = Annotated[int, Field(gt=0)]


class _Request(BaseModel):
    # Fields of the OpenAI API this endpoint does not act on (e.g. `frequency_penalty`) are
    # accepted and ignored, as other OpenAI-compatible servers do; the ones that change what is
    # sampled are checked below.
    model_config = ConfigDict(extra="allow", frozen=True)

    model: StrictStr
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    n: Literal[1] = 1
    stream: bool = False
    seed: int | None = None
    user: StrictStr | None = None
    session_id: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    """Calls sharing it are one trajectory (pass it in the client's `extra_body`, or as the header
    `X-Session-Id`)."""


class _TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[_TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: _Tokens | None = None
    max_completion_tokens: _Tokens | None = None

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    max_tokens: _Tokens | None = None

    @property
    def max_new(self) -> int | None:
        return self.max_tokens


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: StrictStr | None = None
    """A completion id; with a session, the whole session is rewarded."""
    session: StrictStr | None = None
    reward: Annotated[float, Field(allow_inf_nan=False)]
    done: StrictBool = True
    """False: a per-turn reward (for the completion `id` names, or the session's latest turn); the
    session goes on and its reward is the sum (or discounted sum) of its turns' rewards."""


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, type, message, and the offending parameter."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_response(exc: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}
    return web.json_response(body, status=exc.status, headers=headers)


async def parse(request: web.Request, model: type[BaseModel]) -> Any:
    """The request's JSON body as `model`, or a 400 naming what is wrong and where."""
    try:
        body = await request.json()
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc}); send a JSON object",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ApiError(400, f"{where}: {first['msg']}{more}", param=where or None) from None
