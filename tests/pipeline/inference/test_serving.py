"""``nmt serve``'s guard on request bodies: every form of one column of source lines is handed to MLflow as the
same ``{"inputs": [lines]}``, anything else is refused in one line naming what is wrong.

The guard in front of a real served model: tests/pipeline/test_register.py."""

from __future__ import annotations

import json

import pytest

from pipeline.inference import serving

KNOWN = ("beam_size", "alpha", "engine")
LINES = ["A man.", ""]


@pytest.mark.parametrize("payload", [
    {"inputs": LINES},
    {"instances": LINES},
    {"inputs": {"src": LINES}},
    {"inputs": [[line] for line in LINES]},
    {"dataframe_records": [{"src": line} for line in LINES]},
    {"dataframe_split": {"columns": ["src"], "data": [[line] for line in LINES]}},
    {"dataframe_split": {"data": [[line] for line in LINES]}},
])
def test_every_form_of_one_column_reaches_mlflow_as_one_list(payload: dict) -> None:
    for params in ({}, {"params": {"beam_size": 1}}):
        body = serving.check_request(json.dumps({**payload, **params}).encode(), KNOWN)
        assert json.loads(body) == {"inputs": LINES, **params}


def test_one_string_is_one_line_and_a_body_without_one_input_field_is_left_to_mlflow() -> None:
    assert json.loads(serving.check_request(b'{"inputs": "A man."}', KNOWN)) == {"inputs": ["A man."]}
    for body in (b'{"params": {}}', b'{"inputs": ["a"], "instances": ["b"]}', b'["a"]'):
        assert serving.check_request(body, KNOWN) == body


WIDE = "inputs: a table of 2 columns ({}); send one column 'src' holding the source sentences, or a list of strings"


@pytest.mark.parametrize(("payload", "message"), [
    ({"inputs": [["a", "b"], ["c", "d"]]}, WIDE.format("'0', '1'")),
    ({"inputs": [["a"], ["c", "d"]]}, WIDE.format("'0', '1'")),
    ({"inputs": {"src": ["a"], "de": ["b"]}}, WIDE.format("'src', 'de'")),
    ({"dataframe_records": [{"src": "a"}, {"note": "x"}]}, WIDE.format("'src', 'note'")),
    ({"dataframe_split": {"columns": ["src", "de"], "data": [["a", "b"]]}}, WIDE.format("'src', 'de'")),
    ({"dataframe_split": {"data": [["a", "b"]]}}, WIDE.format("'0', '1'")),
    ({"inputs": [1, 2]}, "inputs[0]: a value of type int is not a string; send each source sentence as a string"),
    ({"inputs": ["a", None]}, "inputs[1]: null is not a string"),
    ({"inputs": [{"a": 1}]}, "inputs[0]: a value of type dict is not a string"),
    ({"dataframe_records": [{"src": 3.5}]}, "inputs[0]: a value of type float is not a string"),
    ({"dataframe_records": [{"src": "a"}, {}]}, "inputs[1]: null is not a string"),
    ({"inputs": 7}, "inputs: cannot translate a int; send a list of strings"),
    ({"dataframe_records": {"src": "a"}}, 'dataframe_records: not a list of records; send [{"src": "a sentence"}'),
    ({"dataframe_split": {"columns": ["src"]}}, 'dataframe_split: no "data" list of rows'),
    ({"inputs": ["a"] * 257}, "inputs: 257 lines, more than the 256 one request may hold (MAX_REQUEST_LINES)"),
    ({"inputs": ["x" * 10_001]}, "inputs[0]: 10001 characters, more than the 10000 of one line (MAX_LINE_CHARS)"),
])
def test_anything_but_one_column_of_strings_is_refused_naming_it(payload: dict, message: str) -> None:
    with pytest.raises(serving.Refused) as info:
        serving.check_request(json.dumps(payload).encode(), KNOWN)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)
