"""The MLflow pyfunc translator, logged "from code" by the ``register`` stage.

MLflow executes this file (as a fresh module) when the model is logged and again whenever it is
loaded (``mlflow.pyfunc.load_model``, ``mlflow models serve``); the last line hands it the model
object. It is the one module besides :mod:`pipeline.core.tracking` that imports mlflow, because it *is*
the model definition MLflow loads; nothing in the pipeline imports it.

Artifacts (``context.artifacts``): ``averaged`` (the ``averaged.pt`` of the average stage, which
also embeds the SentencePiece model), ``spm`` (that ``spm.model``, for inspection) and, when the
register stage ran with ``NMT_REGISTER_CTRANSLATE2``, ``ctranslate2`` (its CTranslate2 export).
Model config (``context.model_config``): default ``beam_size`` and ``alpha`` (the values the
evaluate stage chose on the valid set), ``max_len_a``, ``max_len_b``, ``max_tokens`` and ``engine``
(``torch``, or ``ctranslate2`` when the export is there).
Per request, ``params={"beam_size": 4, "alpha": 0.6, "engine": "torch"}`` override the defaults.

Input: strings (a DataFrame whose ``src`` column, or only column, holds the source sentences; a
Series; a list; one string). Output: one German string per input line, normalised and decoded
exactly as ``nmt translate`` does (empty line in, empty line out).
"""

import logging
from typing import Any

import mlflow
import pandas as pd

log = logging.getLogger(__name__)

#: decoding settings used when neither the model config nor the request gives one.
DEFAULTS: dict[str, Any] = {"beam_size": 4, "alpha": 0.6, "max_len_a": 1.0, "max_len_b": 50, "max_tokens": 8192,
                            "engine": "torch"}
#: settings a request may override through ``params``.
REQUEST_PARAMS = ("beam_size", "alpha", "engine")
#: what to do about a shipped CTranslate2 export that fails its digest check.
REGISTER_AGAIN = "register the model again (`dvc repro register` with NMT_REGISTER_CTRANSLATE2 set)"


def source_lines(model_input: Any) -> list[str]:
    """The source sentences of a pyfunc input, in order.

    Raises:
        TypeError: an input that holds no strings column (names what was given).
    """
    if isinstance(model_input, str):
        return [model_input]
    if isinstance(model_input, pd.DataFrame):
        if "src" in model_input.columns:
            column = model_input["src"]
        elif len(model_input.columns) == 1:
            column = model_input.iloc[:, 0]
        else:
            raise TypeError(f"input DataFrame has columns {list(model_input.columns)}; give one column 'src' "
                            "holding the source sentences")
        model_input = column
    if isinstance(model_input, pd.Series):
        model_input = model_input.tolist()
    if hasattr(model_input, "tolist"):  # numpy arrays
        model_input = model_input.tolist()
    if isinstance(model_input, (list, tuple)):
        return ["" if line is None else str(line) for line in model_input]
    raise TypeError(f"cannot translate input of type {type(model_input).__name__}: give a list of strings "
                    "or a DataFrame with a 'src' column")


class Translator(mlflow.pyfunc.PythonModel):
    """Beam-search translation with one ``averaged.pt`` (string in, string out)."""

    def load_context(self, context: Any) -> None:
        """Load ``averaged.pt`` (on CUDA when available), the CTranslate2 export when there is one, and
        the decoding defaults."""
        from pipeline.inference import ct2
        from pipeline.inference.decoding import load_translator

        self._engines: dict[str, Any] = {"torch": load_translator(context.artifacts["averaged"])}
        if "ctranslate2" in context.artifacts:
            self._engines["ctranslate2"] = ct2.load(context.artifacts["ctranslate2"], remedy=REGISTER_AGAIN)
        self._settings = {**DEFAULTS, **{k: v for k, v in (context.model_config or {}).items() if k in DEFAULTS}}
        log.info("translator loaded (%s) with %s", ", ".join(self._engines), self._settings)

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> list[str]:
        """Translate every input line.

        Args:
            context: the pyfunc context (unused; the model was loaded in :meth:`load_context`).
            model_input: source sentences (see :func:`source_lines`).
            params: optional ``beam_size`` (int >= 1), ``alpha`` (float) and ``engine`` (``torch``, or
                ``ctranslate2`` when the model carries the export) for this request.

        Returns:
            One translation per input line.
        """
        from pipeline.inference.translate import translate_lines

        settings = dict(self._settings)
        settings.update({k: v for k, v in (params or {}).items() if k in REQUEST_PARAMS and v is not None})
        beam = int(settings["beam_size"])
        if beam < 1:
            raise ValueError(f"params.beam_size must be >= 1, got {beam}")
        engine = self._engines.get(str(settings["engine"]))
        if engine is None:
            raise ValueError(f"params.engine {settings['engine']!r}: this model has {', '.join(self._engines)} "
                             "(register with NMT_REGISTER_CTRANSLATE2 to ship a CTranslate2 export)")
        lines = source_lines(model_input)
        out, _, _, truncated = translate_lines(
            engine, lines, beam_size=beam, alpha=float(settings["alpha"]),
            max_len_a=float(settings["max_len_a"]), max_len_b=float(settings["max_len_b"]),
            max_tokens=int(settings["max_tokens"]))
        if truncated:
            log.warning("%d line(s) longer than max_positions were truncated", len(truncated))
        return out


mlflow.models.set_model(Translator())
