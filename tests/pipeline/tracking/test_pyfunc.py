"""The served translator's pyfunc in-process, on a real 16-piece model: every request-controlled size is bounded
and every bad field refused before decoding with INVALID_PARAMETER_VALUE (HTTP 400 when served) naming it.

The same checks over HTTP, on a model registered and served for real: tests/pipeline/test_register.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from mlflow.exceptions import MlflowException

from model.config import MAX_ALPHA
from pipeline.inference import serving
from pipeline.tracking import pyfunc
from tests.helpers.models import make_small_vocab_averaged


@pytest.fixture(scope="module")
def translator(tmp_path_factory: pytest.TempPathFactory) -> pyfunc.Translator:
    model = make_small_vocab_averaged(tmp_path_factory.mktemp("pyfunc"))
    translator = pyfunc.Translator()
    translator.load_context(SimpleNamespace(artifacts={"averaged": str(model)},
                                            model_config={"beam_size": 2, "alpha": 0.6, "max_len_b": 5}))
    return translator


def test_strings_within_the_bounds_are_translated(translator: pyfunc.Translator) -> None:
    out = translator.predict(None, ["a b c", "", "x" * serving.MAX_LINE_CHARS], params={"beam_size": 16})
    assert len(out) == 3 and out[1] == ""
    frame = pd.DataFrame({"src": ["ab ba"] * serving.MAX_REQUEST_LINES})
    assert len(translator.predict(None, frame, params={"beam_size": 1, "alpha": MAX_ALPHA})) == 256


@pytest.mark.parametrize(("model_input", "params", "message"), [
    (["a"], {"beam_size": 1000000}, "params.beam_size 1000000: must be an integer from 1 to 64"),
    (["a"], {"beam_size": 0}, "params.beam_size 0: must be an integer from 1 to 64"),
    (["a"], {"beam_size": 17}, "params.beam_size 17: must be at most the vocabulary size (16 pieces)"),
    (["a"], {"alpha": float("nan")}, "params.alpha NaN: must be a finite number from 0 to 10.0"),
    (["a"], {"alpha": float("inf")}, "params.alpha inf: must be a finite number"),
    (["a"], {"alpha": -0.5}, "params.alpha -0.5: must be a finite number"),
    (["a"], {"engine": "onnx" * 50}, "params.engine 'onnxonnx"),
    ([1, 2], {}, "inputs[0]: a value of type int is not a string"),
    (["a", None], {}, "inputs[1]: null is not a string"),
    ([{"a": 1}], {}, "inputs[0]: a value of type dict is not a string"),
    (["a"] * 257, {}, "inputs: 257 lines, more than the 256 one request may hold"),
    (["x" * 10001], {}, "inputs[0]: 10001 characters, more than the 10000 of one line"),
    (pd.DataFrame({"x": ["a"], "y": ["b"]}), {}, "inputs: a table of 2 columns ('x', 'y'); send one column 'src'"),
    (pd.DataFrame({"src": ["a"], "y": ["b"]}), {}, "inputs: a table of 2 columns ('src', 'y'); send one column"),
    (np.array([["a", "b"], ["c", "d"]]), {}, "inputs: a table of 2 columns ('0', '1'); send one column 'src'"),
    ({"src": ["a"], "de": ["b"]}, {}, "inputs: a table of 2 columns ('src', 'de'); send one column 'src'"),
    (pd.DataFrame({"src": [3.5]}), {}, "inputs[0]: a value of type float is not a string"),
])
def test_out_of_bounds_requests_are_refused_naming_the_field(translator: pyfunc.Translator,
                                                            model_input: object, params: dict,
                                                            message: str) -> None:
    with pytest.raises(MlflowException) as info:
        translator.predict(None, model_input, params=params)
    assert info.value.error_code == "INVALID_PARAMETER_VALUE" and info.value.get_http_status_code() == 400
    assert info.value.message.startswith(message) and "\n" not in info.value.message, info.value.message
    assert len(info.value.message) < 300

