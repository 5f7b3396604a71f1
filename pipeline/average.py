"""Stage ``average``: the mean of the last N complete checkpoints, as one self-contained model file.

The paper averages the last 5 checkpoints (written every 10 minutes) of the base model. We average
the model weights of the last ``average.last_n`` checkpoint folders that have their ``DONE`` marker,
ordered by step (a folder without ``DONE`` among them is named in a warning and in the metrics'
``skipped_incomplete``, and the N newest complete ones are used): floating tensors are averaged in fp32 (then cast
back to their dtype), integer and boolean buffers (counters, masks) are taken from the newest checkpoint. The output
``<paths.model>/averaged.pt`` holds ``{"model": state_dict, "config": TransformerConfig dict,
"spm": spm.model bytes}``, so translating needs this one file, and loads with ``weights_only=True``.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from model.config import TransformerConfig
from pipeline.artifacts import checkpoint, model_file, torchfile
from pipeline.core.config import AverageConfig, Params
from pipeline.core.errors import CheckpointError
from pipeline.core.stage import read_json, stage_main
from pipeline.core.textio import atomic_path, refuse_foreign

log = logging.getLogger(__name__)


def complete_checkpoints(train_dir: str | Path) -> list[Path]:
    """Checkpoint folders ``step-NNNNNNNN`` under ``train_dir`` that have ``DONE``, oldest step first."""
    return [folder for _, folder in checkpoint.complete_checkpoints(train_dir)]


def skipped_incomplete(train_dir: str | Path, chosen: list[Path]) -> list[Path]:
    """``step-*`` folders without ``DONE`` newer than the oldest of ``chosen``: the ones averaging passed over."""
    if not chosen:
        return []
    oldest = {p: s for s, p in checkpoint.complete_checkpoints(train_dir)}[chosen[0]]
    return [p for s, p in checkpoint.incomplete_checkpoints(train_dir) if s > oldest]


def corrupt_remedy(folder: Path, window: int) -> str:
    """What to do about a corrupt checkpoint among the ``window`` newest that averaging uses: delete it, and
    which checkpoints a rerun then averages (the ``window`` newest of the others)."""
    others = [p.name for p in complete_checkpoints(folder.parent) if p != folder][-window:]
    if not others:
        return (f"delete the folder {folder} (or move it away) and retrain (`dvc repro train`): it is the only "
                "complete checkpoint")
    return (f"delete the folder {folder} (or move it away) and rerun `dvc repro average`: it then averages "
            f"{', '.join(others)}")


def load_state_dict(path: Path, *, remedy: str | None = None) -> dict[str, torch.Tensor]:
    """Load a ``model.pt`` state_dict on CPU with ``weights_only=True``, after checking it against the size
    and sha256 its folder's ``state.json`` recorded at save (:func:`pipeline.artifacts.checkpoint.verify`;
    a checkpoint without those records is refused).

    Args:
        path: ``<step folder>/model.pt``.
        remedy: what to do about a corrupt file (default: delete the folder and resume training from the newest
            other checkpoint; averaging names what it then averages: :func:`corrupt_remedy`).

    Raises:
        CheckpointError: the file is missing, truncated, changed since it was saved, without a recorded sha256,
            or not a state_dict of tensors.
    """
    fix = remedy or checkpoint.corrupt_remedy(path.parent)
    checkpoint.verify(path.parent, path.name, remedy=fix)
    state = torchfile.load(path, remedy=f"the file is truncated or corrupt: {fix}",
                           missing="missing although DONE exists")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a state_dict of tensors; was it written by the train stage?")
    return state


def _check_same_layout(ref: dict[str, torch.Tensor], ref_path: Path, other: dict[str, torch.Tensor],
                       path: Path) -> None:
    """Raise naming ``path`` and the first offending key if ``other`` differs in keys, shapes or dtypes."""
    missing = sorted(set(ref) - set(other))
    extra = sorted(set(other) - set(ref))
    if missing:
        raise CheckpointError(f"{path}: key {missing[0]!r} is missing (present in {ref_path}); "
                              "the checkpoints come from different models: average a consistent run")
    if extra:
        raise CheckpointError(f"{path}: unexpected key {extra[0]!r} (absent from {ref_path}); "
                              "the checkpoints come from different models: average a consistent run")
    for key, tensor in ref.items():
        if other[key].shape != tensor.shape or other[key].dtype != tensor.dtype:
            raise CheckpointError(
                f"{path}: key {key!r} has shape {list(other[key].shape)} {other[key].dtype} but "
                f"{list(tensor.shape)} {tensor.dtype} in {ref_path}; the checkpoints come from different "
                "models: average a consistent run"
            )


def average_state_dicts(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Mean of the ``model.pt`` files at ``paths`` (oldest first), loaded one at a time.

    Floating tensors: sum in fp32 in the order given, divide by the count, cast back to the original
    dtype. Other dtypes (integer/bool buffers): the newest (last) checkpoint's value.

    Raises:
        CheckpointError: unreadable file, or keys/shapes/dtypes that differ (names file and key).
    """
    if not paths:
        raise CheckpointError("no checkpoints to average")
    first = load_state_dict(paths[0], remedy=corrupt_remedy(paths[0].parent, len(paths)))
    sums = {k: v.to(torch.float32, copy=True) if v.is_floating_point() else v for k, v in first.items()}
    for path in paths[1:]:
        state = load_state_dict(path, remedy=corrupt_remedy(path.parent, len(paths)))
        _check_same_layout(first, paths[0], state, path)
        for key, value in state.items():
            sums[key] = sums[key].add_(value.to(torch.float32)) if value.is_floating_point() else value
    n = float(len(paths))
    return {k: (v.div_(n).to(first[k].dtype) if first[k].is_floating_point() else v.clone())
            for k, v in sums.items()}


def transformer_config(state: dict[str, Any], vocab_size: int, state_path: Path) -> TransformerConfig:
    """The model's config, from ``state.json``'s resolved config and the vocabulary of ``spm.model``.

    Raises:
        CheckpointError: ``state.json`` holds no ``config.model`` section, or the model rejects it.
    """
    section = (state.get("config") or {}).get("model") if isinstance(state, dict) else None
    if not isinstance(section, dict):
        raise CheckpointError(f"{state_path}: no 'config.model' section; was it written by the train stage?")
    saved = section.get("vocab_size", vocab_size)
    if saved != vocab_size:
        raise CheckpointError(f"{state_path}: the model was trained with vocabulary size {saved}, but spm.model has "
                              f"{vocab_size} pieces; average with the BPE model the run was trained with")
    known = set(TransformerConfig.__dataclass_fields__)
    try:
        return TransformerConfig.from_dict({**{k: v for k, v in section.items() if k in known},
                                            "vocab_size": vocab_size})
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{state_path}: its model config is not valid for this code: {exc}") from None


def _check_loads(config: TransformerConfig, weights: dict[str, torch.Tensor], where: Path) -> None:
    """The averaged weights must fit the model built from ``config`` (shapes checked on the meta device)."""
    from model import Transformer

    with torch.device("meta"):
        expected = Transformer(config).state_dict()
    for key in sorted(set(expected) | set(weights)):
        if key not in weights or key not in expected or expected[key].shape != weights[key].shape:
            raise CheckpointError(
                f"{where}: key {key!r} does not fit the model built from state.json's config "
                f"(vocabulary {config.vocab_size} from spm.model); were the checkpoints trained with "
                "this BPE model and code?"
            )


def _choose(last_n: int, train_dir: str | Path) -> tuple[list[Path], list[Path]]:
    """(the newest ``last_n`` complete checkpoint folders, the incomplete ones passed over among them), with a
    warning for fewer than ``last_n`` and for each passed-over folder.

    Raises:
        CheckpointError: no complete checkpoint.
    """
    available = complete_checkpoints(train_dir)
    if not available:
        raise CheckpointError(f"{train_dir}: no complete checkpoint (step-*/ with DONE); run the train stage first")
    chosen = available[-last_n:]
    if len(chosen) < last_n:
        log.warning("average.last_n is %d but only %d complete checkpoint(s) exist in %s: averaging those",
                    last_n, len(chosen), train_dir)
    skipped = skipped_incomplete(train_dir, chosen)
    if skipped:
        log.warning("skipping %s: no DONE marker (a run died while writing it, or it is being written); "
                    "averaging the %d newest complete checkpoints instead: %s", ", ".join(p.name for p in skipped),
                    len(chosen), ", ".join(p.name for p in chosen))
    log.info("averaging %s", ", ".join(p.name for p in chosen))
    return chosen, skipped


def stage(cfg: AverageConfig, *, train_dir: str | Path, bpe_dir: str | Path, model_dir: str | Path) -> dict:
    """Average the last ``cfg.last_n`` complete checkpoints of ``train_dir`` into ``model_dir/averaged.pt``.

    Args:
        cfg: the ``average`` section.
        train_dir: ``paths.train`` with ``step-NNNNNNNN/{model.pt,state.json,DONE}`` folders.
        bpe_dir: ``paths.bpe`` holding ``spm.model`` (embedded in the output).
        model_dir: ``paths.model``; written whole (``averaged.pt``), replacing only a folder this stage wrote.

    Returns:
        The checkpoints and steps used, how many were requested, the incomplete folders (no ``DONE``)
        passed over among them (``skipped_incomplete``, also a warning), the BPE model's sha256 and the
        parameter count.

    Raises:
        CheckpointError: no complete checkpoint, unreadable or mismatched checkpoints.
    """
    from pipeline.core import tracking

    refuse_foreign(Path(model_dir), "model")  # before the work, not only at the swap
    chosen, skipped = _choose(cfg.last_n, train_dir)
    spm_path = Path(bpe_dir) / "spm.model"
    try:
        spm_bytes = spm_path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{spm_path}: not found; run the bpe stage first") from None
    import sentencepiece as spm

    vocab_size = spm.SentencePieceProcessor(model_proto=spm_bytes).get_piece_size()
    newest = chosen[-1] / "state.json"
    try:
        state = read_json(newest)
    except Exception as exc:  # noqa: BLE001 - read_json raises PipelineError
        raise CheckpointError(str(exc)) from None
    config = transformer_config(state, vocab_size, newest)
    weights = average_state_dicts([p / "model.pt" for p in chosen])
    _check_loads(config, weights, chosen[-1] / "model.pt")
    out = model_file.path_in(model_dir)
    with atomic_path(model_dir, role="model") as tmp:  # the folder whole: replaced only if this stage wrote it
        tmp.mkdir()
        model_file.save(model_file.path_in(tmp), weights=weights, config=config, spm=spm_bytes)
    metrics = {
        "checkpoints": [p.name for p in chosen],
        "steps": [int(p.name.split("-")[1]) for p in chosen],
        "requested": cfg.last_n,
        "used": len(chosen),
        "fewer_than_requested": len(chosen) < cfg.last_n,
        "skipped_incomplete": [p.name for p in skipped],
        "spm_sha256": hashlib.sha256(spm_bytes).hexdigest(),
        "parameters": int(sum(v.numel() for v in weights.values() if v.is_floating_point())),
    }
    run = tracking.current()
    run.log_params({"average.checkpoints": ",".join(metrics["checkpoints"])})
    run.log_metrics({"checkpoints_used": len(chosen), "last_step": metrics["steps"][-1]})
    log.info("wrote %s (%d checkpoints, last step %d)", out, len(chosen), metrics["steps"][-1])
    return metrics


def _run(params: Params, args: argparse.Namespace) -> dict:
    paths = params.paths
    return stage(params.average, train_dir=paths.train, bpe_dir=paths.bpe, model_dir=paths.model)


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.average``."""
    return stage_main("average", _run, argv)


if __name__ == "__main__":
    sys.exit(main())
