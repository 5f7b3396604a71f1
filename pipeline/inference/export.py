"""``nmt export``: an ``averaged.pt`` for another inference engine, CTranslate2 (:mod:`pipeline.inference.ct2`) or
Hugging Face ``transformers`` (:mod:`pipeline.inference.hf_export`, imported only for ``--format hf``)."""

from __future__ import annotations

from typing import Any

from pipeline.core.errors import PipelineError
from pipeline.inference import ct2

FORMATS = ("ctranslate2", "hf")


def _cmd_export(args: Any) -> int:
    model = ct2.check_averaged(args.model)
    if args.format == "hf":
        if args.quantization != "float32":
            raise PipelineError(f"--quantization {args.quantization}: a Hugging Face export holds float32 weights; "
                                "leave --quantization out with --format hf")
        from pipeline.inference import hf_export

        hf_export.export(model, args.output)
    else:
        ct2.export(model, args.output, args.quantization)
    return 0


def add_parser(sub: Any) -> None:
    """Register ``export`` on the ``nmt`` sub-command parser."""
    p = sub.add_parser("export", help="export an averaged.pt for another inference engine (CTranslate2, Hugging Face "
                                      "transformers)")
    p.add_argument("--format", choices=FORMATS, default="ctranslate2",
                   help="ctranslate2 (default) or hf: a transformers MarianMT folder (needs the hf extra)")
    p.add_argument("--model", required=True, help="an averaged.pt written by the average stage")
    p.add_argument("--output", required=True,
                   help="folder to write (a folder an earlier export of the same format wrote is replaced "
                        "atomically; any other is refused)")
    p.add_argument("--quantization", choices=ct2.QUANTIZATIONS, default="float32",
                   help="weight type in a CTranslate2 export (int8: a quarter of the size, 1.0-2.3x float32's speed "
                        "on the 2-core CPUs of benchmarks/RESULTS.md)")
    p.set_defaults(func=_cmd_export)
