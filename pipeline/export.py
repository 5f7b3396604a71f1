"""Optional DVC stage ``export`` (``dvc repro export/dvc.yaml``): the averaged model as a CTranslate2 model folder
``<paths.model>-ct2/``, as ``nmt export --format ctranslate2`` writes it; no MLflow run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.artifacts import model_file
from pipeline.core.config import Params
from pipeline.core.stage import run_cli, stage_parser
from pipeline.inference import ct2


def output_dir(model_dir: str | Path) -> Path:
    """``<paths.model>-ct2``: beside the model folder, not inside it (DVC tracks that one as ``average``'s)."""
    return Path(f"{str(model_dir).rstrip('/')}-ct2")


def _run(params: Params, args: argparse.Namespace) -> None:
    model_dir = params.paths.model
    ct2.export(model_file.path_in(model_dir), output_dir(model_dir), args.quantization)


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.export [--quantization Q]``."""
    parser = stage_parser("optional pipeline stage export: the averaged model as a CTranslate2 model directory")
    parser.add_argument("--quantization", default="int8", choices=ct2.QUANTIZATIONS,
                        help="CTranslate2 weight type (default: int8)")
    return run_cli("export", _run, argv, parser)


if __name__ == "__main__":
    sys.exit(main())
