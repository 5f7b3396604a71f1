"""The app ``nmt serve`` runs: MLflow's own scoring server (``mlflow.pyfunc.scoring_server.init``) for the model at
``_SERVER_MODEL_PATH``, behind a guard for what MLflow's server does not bound before the model is reached.

MLflow's server decodes the JSON body itself, so a list nested 100,000 deep (RecursionError) or a 5,000-digit
integer (ValueError past Python's ``int`` digit limit) ends in HTTP 500 and an ASGI traceback; an unknown
``params`` key is dropped with a log warning (``_enforce_params_schema`` in mlflow/models/utils.py); and an error
quotes the whole input (``Failed to predict data '...'`` in mlflow/pyfunc/scoring_server/__init__.py). The guard
answers the first three with HTTP 400 naming the problem, and cuts the quoted input out of any error it passes on.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The largest request body: 256 lines of 10,000 characters (mlflow_model.MAX_REQUEST_LINES, MAX_LINE_CHARS) at
#: up to 4 UTF-8 bytes each (6 when JSON-escaped), with room for the JSON around them.
MAX_BODY_BYTES = 16 << 20
#: The most digits of one JSON integer (a beam of 64 needs 2; Python refuses past 4,300 with a ValueError).
MAX_INT_DIGITS = 30
#: The most characters of an error message passed on.
MAX_MESSAGE_CHARS = 1000
_ECHO = re.compile(r"^Failed to predict data '.*'\. \nError: ", re.DOTALL)


class Refused(ValueError):
    """A request the guard answers with HTTP 400 and this message."""


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise Refused(f"an integer of {len(text.lstrip('-'))} digits, more than the {MAX_INT_DIGITS} any field "
                      "takes (MAX_INT_DIGITS)")
    return int(text)


def check_request(body: bytes, known_params: tuple[str, ...]) -> None:
    """Refuse a JSON request body that MLflow's server would fail on with HTTP 500, or whose ``params`` hold a
    key the model does not read.

    Raises:
        Refused: the body is too large, not JSON, nested too deeply, holds a huge integer or an unknown param.
    """
    if len(body) > MAX_BODY_BYTES:
        raise Refused(f"a request of {len(body)} bytes, more than the {MAX_BODY_BYTES} one request may hold "
                      "(MAX_BODY_BYTES); split it")
    try:
        payload = json.loads(body, parse_int=_bounded_int)
    except RecursionError:
        raise Refused("the JSON is nested too deeply; send a list of strings") from None
    except Refused:
        raise
    except ValueError as exc:  # JSONDecodeError, invalid UTF-8: MLflow's own message would quote the whole body
        raise Refused(f"not valid JSON ({str(exc)[:120]}); send {{\"inputs\": [\"a sentence\", ...]}}") from None
    params = payload.get("params") if isinstance(payload, dict) else None
    if isinstance(params, dict) and (unknown := [str(k)[:40] for k in params if k not in known_params]):
        raise Refused(f"params: unknown {', '.join(map(repr, unknown[:5]))}; this model reads "
                      f"{', '.join(known_params)}")


def clip_error(body: bytes) -> bytes:
    """An MLflow error body without the input it quotes, its message cut to :data:`MAX_MESSAGE_CHARS`."""
    try:
        error = json.loads(body)
    except ValueError:
        return body[:MAX_MESSAGE_CHARS]
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return body if len(body) <= MAX_MESSAGE_CHARS else body[:MAX_MESSAGE_CHARS]
    message = _ECHO.sub("Error: ", error["message"])
    error["message"] = message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS - 3] + "..."
    error.pop("stack_trace", None)
    return json.dumps(error).encode()


def _answer(status: int, body: bytes) -> list[Message]:
    return [{"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]},
            {"type": "http.response.body", "body": body}]


def guard(app: App, known_params: tuple[str, ...]) -> App:
    """``app`` behind :func:`check_request` for ``POST /invocations`` and :func:`clip_error` for its errors."""

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/invocations" or scope["method"] != "POST":
            return await app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:  # read at most MAX_BODY_BYTES + 1: a larger body is refused unread
            message = await receive()
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False) and size <= MAX_BODY_BYTES
        body = b"".join(chunks)
        try:
            check_request(body, known_params)
        except Refused as exc:
            error = json.dumps({"error_code": "INVALID_PARAMETER_VALUE", "message": f"Error: {exc}"}).encode()
            for message in _answer(400, error):
                await send(message)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # a disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        held: list[Message] = []

        async def hold(message: Message) -> None:
            held.append(message)

        await app(scope, replay, hold)
        start = next(m for m in held if m["type"] == "http.response.start")
        if start["status"] < 400:
            for message in held:
                await send(message)
            return
        for message in _answer(start["status"], clip_error(b"".join(m.get("body", b"") for m in held[1:]))):
            await send(message)

    return guarded


def build_app() -> App:
    """MLflow's scoring app for the model at ``_SERVER_MODEL_PATH`` (set by ``scoring_server.get_cmd``), guarded."""
    from mlflow.pyfunc import scoring_server

    model = scoring_server.load_model_with_mlflow_config(os.environ[scoring_server._SERVER_MODEL_PATH])
    schema = model.metadata.get_params_schema()
    known = tuple(p.name for p in schema.params) if schema is not None else ()
    return guard(scoring_server.init(model), known)


def __getattr__(name: str) -> App:
    """``app``, built on first use: uvicorn's ``pipeline.inference.serving:app`` loads the model then, not an
    import of this module (PEP 562)."""
    if name != "app":
        raise AttributeError(name)
    globals()["app"] = built = build_app()
    return built
