"""The mean of the last N complete checkpoints, as the paper averages the last 5 of the base model."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from model import Transformer, TransformerConfig
from pipeline.artifacts import checkpoint
from pipeline.core.errors import CheckpointError

log = logging.getLogger(__name__)


def choose(train_dir: str | Path, last_n: int) -> tuple[list[Path], list[Path]]:
    """The newest ``last_n`` complete checkpoint folders (oldest first), and the incomplete ones passed over."""
    available = checkpoint.complete_checkpoints(train_dir)
    if not available:
        raise CheckpointError(f"{train_dir}: no complete checkpoint (step-*/ with DONE); run the train stage first")
    oldest = available[-last_n:][0][0]
    chosen = [folder for _, folder in available[-last_n:]]
    if len(chosen) < last_n:
        log.warning("average.last_n is %d but only %d complete checkpoint(s) exist in %s: averaging those",
                    last_n, len(chosen), train_dir)
    skipped = [folder for step, folder in checkpoint.incomplete_checkpoints(train_dir) if step > oldest]
    if skipped:
        log.warning("skipping %s: no DONE marker (a run died while writing it, or it is being written); "
                    "averaging the %d newest complete checkpoints instead: %s", ", ".join(p.name for p in skipped),
                    len(chosen), ", ".join(p.name for p in chosen))
    log.info("averaging %s", ", ".join(p.name for p in chosen))
    return chosen, skipped


def _check_same_layout(ref: dict[str, torch.Tensor], ref_path: Path, other: dict[str, torch.Tensor],
                       path: Path) -> None:
    """Raise naming ``path`` and the first offending key if ``other`` differs in keys, shapes or dtypes."""
    fix = "the checkpoints come from different models: average a consistent run"
    if missing := sorted(set(ref) - set(other)):
        raise CheckpointError(f"{path}: key {missing[0]!r} is missing (present in {ref_path}); {fix}")
    if extra := sorted(set(other) - set(ref)):
        raise CheckpointError(f"{path}: unexpected key {extra[0]!r} (absent from {ref_path}); {fix}")
    for key, tensor in ref.items():
        if other[key].shape != tensor.shape or other[key].dtype != tensor.dtype:
            raise CheckpointError(f"{path}: key {key!r} has shape {list(other[key].shape)} {other[key].dtype} but "
                                  f"{list(tensor.shape)} {tensor.dtype} in {ref_path}; {fix}")


def average_state_dicts(folders: list[Path]) -> dict[str, torch.Tensor]:
    """Mean of the ``model.pt`` files of ``folders``, loaded one at a time (CheckpointError: unreadable, unlike)."""
    if not folders:
        raise CheckpointError("no checkpoints to average")
    first = checkpoint.load_state_dict(folders[0], remedy=checkpoint.corrupt_remedy(folders[0], len(folders)))
    sums = {k: v.to(torch.float32, copy=True) if v.is_floating_point() else v for k, v in first.items()}
    for folder in folders[1:]:
        state = checkpoint.load_state_dict(folder, remedy=checkpoint.corrupt_remedy(folder, len(folders)))
        _check_same_layout(first, folders[0] / checkpoint.MODEL, state, folder / checkpoint.MODEL)
        for key, value in state.items():
            sums[key] = sums[key].add_(value.to(torch.float32)) if value.is_floating_point() else value
    n = float(len(folders))
    return {k: (v.div_(n).to(first[k].dtype) if first[k].is_floating_point() else v.clone()) for k, v in sums.items()}


def check_fits(config: TransformerConfig, weights: dict[str, torch.Tensor], where: Path) -> None:
    """Refuse, naming ``where`` and the first key, ``weights`` that do not fit ``config``'s model."""
    with torch.device("meta"):
        expected = Transformer(config).state_dict()
    for key in sorted(set(expected) | set(weights)):
        if key not in weights or key not in expected or expected[key].shape != weights[key].shape:
            raise CheckpointError(
                f"{where}: key {key!r} does not fit the model built from state.json's config "
                f"(vocabulary {config.vocab_size} from spm.model); were the checkpoints trained with "
                "this BPE model and code?"
            )
