"""The guard in front of MLflow's own scoring server in the app ``nmt serve`` runs (pipeline/tracking/scoring_app.py),
for what MLflow's server does not bound before the model is reached.

MLflow's server decodes the JSON body itself, so a list nested 100,000 deep (RecursionError) or a 5,000-digit
integer (ValueError past Python's ``int`` digit limit) ends in HTTP 500 and an ASGI traceback; an unknown
``params`` key is dropped with a log warning (``_enforce_params_schema`` in mlflow/models/utils.py); and an error
quotes the whole input (``Failed to predict data '...'`` in mlflow/pyfunc/scoring_server/__init__.py). The guard
answers the first three with HTTP 400 naming the problem, and cuts the quoted input out of any error it passes on.

The model's string input schema (pipeline/tracking/model_registry.py) is enforced by MLflow before the model is reached
(``_enforce_schema`` in mlflow/models/utils.py): it keeps column 0 of a wider table, refuses ``[1, 2]`` in its own
words and nests ``{"src": [...]}`` one level deeper. So the guard also reads the request's one column of source
lines itself (:func:`request_lines`), refuses anything else naming it, and hands MLflow ``{"inputs": [lines]}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The most source lines one request may hold: a request is decoded whole, and the scoring server gives up on
#: it after MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT (60 s) while the decode goes on.
MAX_REQUEST_LINES = 256
#: The most characters of one source line: the model reads at most ``max_positions`` tokens of it anyway.
MAX_LINE_CHARS = 10_000
#: The largest request body: MAX_REQUEST_LINES lines of MAX_LINE_CHARS characters at up to 4 UTF-8 bytes each
#: (6 when JSON-escaped), with room for the JSON around them.
MAX_BODY_BYTES = 16 << 20
#: The most digits of one JSON integer (a beam of 64 needs 2; Python refuses past 4,300 with a ValueError).
MAX_INT_DIGITS = 30
#: The most characters of an error message passed on.
MAX_MESSAGE_CHARS = 1000
_ECHO = re.compile(r"^Failed to predict data '.*'\. \nError: ", re.DOTALL)
#: The JSON fields of MLflow's scoring server that carry the model input (mlflow/pyfunc/scoring_server).
INPUT_FIELDS = ("inputs", "instances", "dataframe_split", "dataframe_records")


class Refused(ValueError):
    """A request the guard answers with HTTP 400 and this message."""


def checked_lines(values: list[Any] | tuple[Any, ...]) -> list[str]:
    """``values`` as source lines: at most :data:`MAX_REQUEST_LINES` strings of ≤ :data:`MAX_LINE_CHARS` each.

    Raises:
        Refused: too many lines, a value that is not a string (a NaN read as null), a line too long.
    """
    if len(values) > MAX_REQUEST_LINES:
        raise Refused(f"inputs: {len(values)} lines, more than the {MAX_REQUEST_LINES} one request may hold "
                      "(MAX_REQUEST_LINES); split the request")
    for i, line in enumerate(values):
        if not isinstance(line, str):
            null = line is None or (isinstance(line, float) and line != line)  # pandas reads a missing value as NaN
            what = "null" if null else f"a value of type {type(line).__name__}"
            raise Refused(f"inputs[{i}]: {what} is not a string; send each source sentence as a string "
                          "(\"\" for an empty line)")
        if len(line) > MAX_LINE_CHARS:
            raise Refused(f"inputs[{i}]: {len(line)} characters, more than the {MAX_LINE_CHARS} of one line "
                          "(MAX_LINE_CHARS); split it into sentences")
    return [str(line) for line in values]  # numpy strings as plain str


def wide_table(names: list[str]) -> Refused:
    """The refusal of a table of more than one column, naming (up to five of) its columns."""
    listed = ", ".join(repr(n[:40]) for n in names[:5]) + (" ..." if len(names) > 5 else "")
    return Refused(f"inputs: a table of {len(names)} columns ({listed}); send one column 'src' holding the source "
                   "sentences, or a list of strings")


def _column(value: Any) -> list[Any]:
    """The one column of an ``inputs``/``instances`` value: a string, a list, rows of one value, a dict of one list."""
    if isinstance(value, dict):
        if len(value) > 1:
            raise wide_table([str(k) for k in value])
        value = next(iter(value.values()), [])
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise Refused(f"inputs: cannot translate a {type(value).__name__}; send a list of strings or one column "
                      "'src' holding the source sentences")
    if value and all(isinstance(row, list) for row in value):  # [["a", "b"], ...]: rows of a table
        if (width := max(len(row) for row in value)) > 1:
            raise wide_table([str(i) for i in range(width)])
        return [row[0] if row else None for row in value]
    return value


def _records_column(records: Any) -> list[Any]:
    """The one column of ``dataframe_records`` (a list of one-key objects)."""
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise Refused('dataframe_records: not a list of records; send [{"src": "a sentence"}, ...]')
    names = list(dict.fromkeys(str(k) for r in records for k in r))
    if len(names) > 1:
        raise wide_table(names)
    return [next(iter(r.values()), None) for r in records]


def _split_column(split: Any) -> list[Any]:
    """The one column of ``dataframe_split`` (``{"columns": [name], "data": [[value], ...]}``)."""
    rows = split.get("data") if isinstance(split, dict) else None
    if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
        raise Refused('dataframe_split: no "data" list of rows; send {"columns": ["src"], "data": [["a sentence"]]}')
    width = max((len(row) for row in rows), default=1)
    columns = split.get("columns")
    names = [str(c) for c in columns] if isinstance(columns, list) and columns else [str(i) for i in range(width)]
    if len(names) > 1 or width > 1:
        raise wide_table(names if len(names) > 1 else [str(i) for i in range(width)])
    return [row[0] if row else None for row in rows]


def request_lines(payload: Any) -> list[str] | None:
    """The source lines of a parsed request body, or None when it has not exactly one of :data:`INPUT_FIELDS`
    (MLflow's server refuses that in its own words).

    Raises:
        Refused: a table of more than one column, a value that is not a string, too many or too long lines.
    """
    fields = [f for f in INPUT_FIELDS if f in payload] if isinstance(payload, dict) else []
    if len(fields) != 1:
        return None
    value = payload[fields[0]]
    if fields[0] == "dataframe_records":
        return checked_lines(_records_column(value))
    if fields[0] == "dataframe_split":
        return checked_lines(_split_column(value))
    return checked_lines(_column(value))


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise Refused(f"an integer of {len(text.lstrip('-'))} digits, more than the {MAX_INT_DIGITS} any field "
                      "takes (MAX_INT_DIGITS)")
    return int(text)


def check_request(body: bytes, known_params: tuple[str, ...]) -> bytes:
    """Refuse a JSON request body that MLflow's server would fail on with HTTP 500, whose ``params`` hold a key the
    model does not read, or whose input is not one column of source lines; return the body to pass on
    (``{"inputs": [lines], "params": ...}``, or the body itself when :func:`request_lines` leaves it to MLflow).

    Raises:
        Refused: the body is too large, not JSON, nested too deeply, holds a huge integer or an unknown param, or
            its input is not one column of at most MAX_REQUEST_LINES strings of at most MAX_LINE_CHARS.
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
    if (lines := request_lines(payload)) is None:
        return body
    return json.dumps({"inputs": lines, **({"params": params} if params is not None else {})}).encode()


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
            body = check_request(body, known_params)
        except Refused as exc:
            error = json.dumps({"error_code": "INVALID_PARAMETER_VALUE", "message": f"Error: {exc}"}).encode()
            for message in _answer(400, error):
                await send(message)
            return
        scope = {**scope, "headers": [(k, str(len(body)).encode() if k.lower() == b"content-length" else v)
                                      for k, v in scope["headers"]]}
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

