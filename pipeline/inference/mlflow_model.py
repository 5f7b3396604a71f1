"""The MLflow pyfunc translator, logged "from code" by the ``register`` stage: MLflow executes this file as a fresh
module when the model is logged or loaded, so it imports mlflow itself and nothing in the pipeline imports it.
Lines in, one translation per line out, as ``nmt translate`` gives them; a request out of bounds is refused before
decoding with ``INVALID_PARAMETER_VALUE`` naming the field (HTTP 400 from ``mlflow models serve``)."""

import logging
import math
import numbers
from typing import Any

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

log = logging.getLogger(__name__)

#: decoding settings used when neither the model config nor the request gives one.
DEFAULTS: dict[str, int | float | str] = {"beam_size": 4, "alpha": 0.6, "max_len_a": 1.0, "max_len_b": 50,
                                          "max_tokens": 8192, "engine": "torch"}
#: settings a request may override through ``params``.
REQUEST_PARAMS = ("beam_size", "alpha", "engine")
#: The most source lines one request may hold: a request is decoded whole, and the scoring server gives up on
#: it after MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT (60 s) while the decode goes on.
MAX_REQUEST_LINES = 256
#: The most characters of one source line: the model reads at most ``max_positions`` tokens of it anyway.
MAX_LINE_CHARS = 10_000
#: what to do about a shipped CTranslate2 export that fails its digest check.
REGISTER_AGAIN = "register the model again (`dvc repro register` with NMT_REGISTER_CTRANSLATE2 set)"


def invalid(message: str) -> MlflowException:
    """A refused request: ``mlflow models serve`` answers it with HTTP 400 and ``message``."""
    return MlflowException(message, error_code=INVALID_PARAMETER_VALUE)


def _table_columns(model_input: Any) -> list[str] | None:
    """The column names of a table with more than one column (a DataFrame, a dict of columns, a 2-D array)."""
    if isinstance(model_input, pd.DataFrame) and len(model_input.columns) > 1:
        return [str(c) for c in model_input.columns]
    if isinstance(model_input, dict) and len(model_input) > 1:
        return [str(k) for k in model_input]
    if getattr(model_input, "ndim", 1) == 2 and model_input.shape[1] > 1:  # "inputs": [["a", "b"], ...]
        return [str(i) for i in range(model_input.shape[1])]
    return None


def _one_column(model_input: Any) -> Any:
    """The one column of a table (DataFrame, dict, 2-D array); a list, Series or 1-D array as it is.

    Raises:
        MlflowException: a table of more than one column, naming the column to send.
    """
    if (names := _table_columns(model_input)) is not None:
        listed = ", ".join(repr(n[:40]) for n in names[:5]) + (" ..." if len(names) > 5 else "")
        raise invalid(f"inputs: a table of {len(names)} columns ({listed}); send one column 'src' holding the "
                      "source sentences, or a list of strings")
    if isinstance(model_input, pd.DataFrame):
        return model_input.iloc[:, 0]
    if isinstance(model_input, dict):  # "inputs": {"src": [...]}
        model_input = next(iter(model_input.values()), [])
    if getattr(model_input, "ndim", 1) == 0:  # "inputs": "one sentence" arrives as a 0-d array
        model_input = model_input.item()
    if isinstance(model_input, str):
        return [model_input]
    return model_input[:, 0] if getattr(model_input, "ndim", 1) == 2 else model_input


def source_lines(model_input: Any) -> list[str]:
    """The lines of a pyfunc input (DataFrame, dict, array, Series, list, string), each a string of
    ≤ :data:`MAX_LINE_CHARS`. The model is logged without an input schema (pipeline/inference/registry.py), so
    it sees the request's table whole: MLflow's schema enforcement would keep column 0 of a wider one."""
    model_input = _one_column(model_input)
    if not isinstance(model_input, (list, tuple)) and not hasattr(model_input, "tolist"):  # Series, numpy arrays
        raise invalid(f"inputs: cannot translate a {type(model_input).__name__}; send a list of strings or one "
                      "column 'src' holding the source sentences")
    if len(model_input) > MAX_REQUEST_LINES:
        raise invalid(f"inputs: {len(model_input)} lines, more than the {MAX_REQUEST_LINES} one request may hold "
                      "(MAX_REQUEST_LINES); split the request")
    lines = model_input if isinstance(model_input, (list, tuple)) else model_input.tolist()
    for i, line in enumerate(lines):
        if not isinstance(line, str):
            what = "null" if line is None else f"a value of type {type(line).__name__}"
            raise invalid(f"inputs[{i}]: {what} is not a string; send each source sentence as a string "
                          "(\"\" for an empty line)")
        if len(line) > MAX_LINE_CHARS:
            raise invalid(f"inputs[{i}]: {len(line)} characters, more than the {MAX_LINE_CHARS} of one line "
                          "(MAX_LINE_CHARS); split it into sentences")
    return [str(line) for line in lines]  # numpy strings as plain str


class Translator(mlflow.pyfunc.PythonModel):
    """Beam-search translation with one ``averaged.pt`` (string in, string out)."""

    def load_context(self, context: Any) -> None:
        """Load ``averaged.pt`` (on CUDA when available), the CTranslate2 export if any, the decoding defaults."""
        from pipeline.inference import ct2
        from pipeline.inference.decoding import load_translator

        self._engines: dict[str, Any] = {"torch": load_translator(context.artifacts["averaged"])}
        if "ctranslate2" in context.artifacts:
            self._engines["ctranslate2"] = ct2.load(context.artifacts["ctranslate2"], remedy=REGISTER_AGAIN)
        self._settings = {**DEFAULTS, **{k: v for k, v in (context.model_config or {}).items() if k in DEFAULTS}}
        log.info("translator loaded (%s) with %s", ", ".join(self._engines), self._settings)

    def predict(self, context: Any, model_input: pd.DataFrame,
                params: dict[str, int | float | str] | None = None) -> list[str]:
        """One translation per line of ``model_input`` (:func:`source_lines`), with this request's ``params``.

        Raises:
            MlflowException: (``INVALID_PARAMETER_VALUE``) a param or input out of bounds, before any decoding.
        """
        from model.config import MAX_ALPHA, beam_size_problem
        from pipeline.inference.translate import translate_lines

        settings = dict(self._settings)
        settings.update({k: v for k, v in (params or {}).items() if k in REQUEST_PARAMS and v is not None})
        engine = self._engines.get(settings["engine"]) if isinstance(settings["engine"], str) else None
        if engine is None:
            raise invalid(f"params.engine {settings['engine']!r:.40}: this model has {', '.join(self._engines)} "
                          "(register with NMT_REGISTER_CTRANSLATE2 to ship a CTranslate2 export)")
        beam = settings["beam_size"]
        beam = int(beam) if isinstance(beam, numbers.Integral) and not isinstance(beam, bool) else beam  # numpy ints
        if problem := beam_size_problem(beam, engine.config.vocab_size):
            raise invalid(f"params.beam_size {beam!r:.40}: {problem}")
        alpha = settings["alpha"]
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= MAX_ALPHA:
            shown = "NaN" if isinstance(alpha, float) and math.isnan(alpha) else f"{alpha!r:.40}"
            raise invalid(f"params.alpha {shown}: must be a finite number from 0 to {MAX_ALPHA} (MAX_ALPHA)")
        out, _, _, truncated = translate_lines(
            engine, source_lines(model_input), beam_size=beam, alpha=float(alpha),
            max_len_a=float(settings["max_len_a"]), max_len_b=float(settings["max_len_b"]),
            max_tokens=int(settings["max_tokens"]))
        if truncated:
            log.warning("%d line(s) longer than max_positions were truncated", len(truncated))
        return out


mlflow.models.set_model(Translator())
