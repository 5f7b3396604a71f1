"""Stage ``train`` (one worker): ``python -m pipeline.launch`` starts ``torchrun -m pipeline.train``.

Run alone, this module trains in a single process; the loop is :mod:`pipeline.training.loop`
(:func:`stage` is its :func:`~pipeline.training.loop.train`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from pipeline.core import env
from pipeline.core.config import Params
from pipeline.core.stage import stage_main
from pipeline.training.loop import train as stage

__all__ = ["main", "stage"]


def _run(params: Params, args: argparse.Namespace) -> dict:
    threads = env.settings().threads
    if threads:
        torch.set_num_threads(threads)
    paths = params.paths
    return stage(params.train, model_cfg=params.model, seed=params.seed, shards_dir=paths.shards,
                 spm_model=Path(paths.bpe) / "spm.model", run_dir=paths.train,
                 plots_path=Path(paths.plots) / "train.csv", device=env.settings().device)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m pipeline.train [--params params.yaml]`` (normally under torchrun via pipeline.launch)."""
    return stage_main("train", _run, argv)


if __name__ == "__main__":
    sys.exit(main())
