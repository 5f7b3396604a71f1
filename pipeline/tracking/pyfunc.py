"""The MLflow pyfunc translator, logged "from code" by the ``register`` stage: MLflow executes this file as a fresh
module when the model is logged or loaded, so it imports mlflow itself and nothing in the pipeline imports it.
Lines in, one translation per line out, as ``nmt translate`` gives them; a request out of bounds is refused before
decoding with ``INVALID_PARAMETER_VALUE`` naming the field (HTTP 400 from ``mlflow models serve``); the bounds and
their messages are the serving guard's (pipeline/inference/serving.py)."""

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
        Refused: a table of more than one column, naming the column to send.
    """
    from pipeline.inference.serving import wide_table

    if (names := _table_columns(model_input)) is not None:
        raise wide_table(names)
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
    """The lines of a pyfunc input (DataFrame, dict, array, Series, list, string), each a string of at most
    ``MAX_LINE_CHARS`` (:func:`pipeline.inference.serving.checked_lines`).

    Loaded with MLflow, the model gets its input after MLflow enforced the string input schema
    (pipeline/tracking/model_registry.py): one column, non-strings refused in MLflow's words; served by ``nmt serve``,
    after the guard read the request (:func:`pipeline.inference.serving.request_lines`). Called directly, it
    checks the input whole.

    Raises:
        MlflowException: (``INVALID_PARAMETER_VALUE``) a wider table, a value that is not a string, too many or
            too long lines.
    """
    from pipeline.inference.serving import Refused, checked_lines

    try:
        model_input = _one_column(model_input)
        if not isinstance(model_input, (list, tuple)) and not hasattr(model_input, "tolist"):  # Series, arrays
            raise Refused(f"inputs: cannot translate a {type(model_input).__name__}; send a list of strings or one "
                          "column 'src' holding the source sentences")
        return checked_lines(model_input if isinstance(model_input, (list, tuple)) else model_input.tolist())
    except Refused as exc:
        raise invalid(str(exc)) from None


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
