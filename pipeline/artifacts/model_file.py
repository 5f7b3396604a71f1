"""``averaged.pt``, the one file a translation needs: its only writer and reader.

The file holds ``{"model": state_dict, "config": TransformerConfig as dict, "spm": spm.model bytes,
"sha256": digest}`` and loads with ``torch.load(weights_only=True)``. The average stage :func:`save`\\ s
it, with the config of its newest checkpoint (:func:`checkpoint_config`); decoding, ``nmt translate``, the
MLflow translator, register and the audit :func:`load` or :func:`describe` it.

``sha256`` is the digest of the contents (:func:`content_sha256`: every tensor's name, dtype, shape and
bytes, the config as sorted JSON, the BPE model), recorded at save and checked at every read, so bytes
changed after the fact (bit rot, a bad copy) are refused although the file still unpickles; the file
stays self-contained and byte-identical for equal contents. A file without the ``sha256`` key (from before
the digest was recorded, or edited) is refused: a missing digest never skips the check.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model import TransformerConfig
from pipeline.artifacts import checkpoint, torchfile
from pipeline.core.errors import CheckpointError
from pipeline.core.textio import atomic_path

NAME = "averaged.pt"
KEYS = ("model", "config", "spm")
REMEDY = "rerun `dvc repro average` (or copy the file again)"


@dataclass(frozen=True)
class ModelFile:
    """The contents of an ``averaged.pt``."""

    weights: dict[str, torch.Tensor]
    config: TransformerConfig
    spm: bytes


def path_in(model_dir: str | Path) -> Path:
    """Where the average stage writes the file inside ``paths.model``."""
    return Path(model_dir) / NAME


def content_sha256(weights: dict[str, torch.Tensor], config: dict[str, int | float | bool], spm: bytes) -> str:
    """Hex sha256 of the contents: each tensor (sorted by name) as name, dtype, shape and raw bytes, then the
    config as sorted JSON, then the BPE model bytes. Independent of how ``torch.save`` lays out the zip."""
    digest = hashlib.sha256()
    for key in sorted(weights):
        tensor = weights[key].detach().cpu().contiguous().reshape(-1)
        digest.update(f"{key}\0{tensor.dtype}\0{list(weights[key].shape)}\0{tensor.numel()}\0".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(b"\0")
    digest.update(spm)
    return digest.hexdigest()


def save(path: str | Path, *, weights: dict[str, torch.Tensor], config: TransformerConfig, spm: bytes) -> None:
    """Write the file atomically with its content sha256; equal contents give equal bytes (``torch.save``
    into memory first)."""
    buffer = io.BytesIO()
    config_dict = config.to_dict()
    torch.save({"model": weights, "config": config_dict, "spm": spm,
                "sha256": content_sha256(weights, config_dict, spm)}, buffer)
    with atomic_path(path) as tmp:
        tmp.write_bytes(buffer.getvalue())


def _read(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    blob = torchfile.load(path, mmap=mmap, remedy=f"the file is truncated or corrupt: {REMEDY}",
                          missing="model file not found; run `dvc repro average` or pass --model")
    if not isinstance(blob, dict) or not set(KEYS) <= set(blob):
        raise CheckpointError(f"{path}: not an averaged model (needs keys {', '.join(KEYS)}); {REMEDY}")
    state = blob["model"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: no 'model' state_dict of tensors; was it written by the average stage?")
    recorded = blob.get("sha256")
    if not isinstance(recorded, str):
        raise CheckpointError(f"{path}: no 'sha256' key, so its content cannot be checked (written by an older "
                              f"version, or edited); {REMEDY}")
    try:
        actual = content_sha256(state, blob["config"], blob["spm"])
    except (TypeError, ValueError, RuntimeError):
        actual = None
    if actual != recorded:
        raise CheckpointError(f"{path}: content does not match the sha256 recorded at save (bit rot, a bad copy "
                              f"or an edit?); {REMEDY}")
    return blob


def load(path: str | Path, *, mmap: bool = False) -> ModelFile:
    """Read and check the file (weights not yet fitted to a model: see :func:`build_model`).

    Raises:
        CheckpointError: missing, truncated or corrupt file, no ``sha256`` key or contents that do not match
            the sha256 recorded at save, or not the average stage's format (names the path and the remedy).
    """
    path = Path(path)
    blob = _read(path, mmap=mmap)
    try:
        config = TransformerConfig.from_dict(blob["config"])
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: its config does not fit this code ({exc}); {REMEDY}") from None
    return ModelFile(weights=blob["model"], config=config, spm=blob["spm"])


def verify(path: str | Path) -> None:
    """Check the file (readable, the average stage's format, contents matching the sha256 recorded at save)
    without keeping it (memory-mapped).

    Raises:
        CheckpointError: as :func:`load`.
    """
    _read(Path(path), mmap=True)


def checkpoint_config(folder: str | Path, vocab_size: int) -> TransformerConfig:
    """The config of the model in a checkpoint folder: ``state.json``'s ``config.model`` with the vocabulary
    size of ``spm.model`` (``averaged.pt`` takes it from the newest checkpoint averaged).

    Raises:
        CheckpointError: ``state.json`` unreadable or without a ``config.model`` section, a vocabulary size
            other than ``vocab_size``, or a config the model rejects.
    """
    state, where = checkpoint.read_state(folder), Path(folder) / checkpoint.STATE
    section = (state.get("config") or {}).get("model") if isinstance(state, dict) else None
    if not isinstance(section, dict):
        raise CheckpointError(f"{where}: no 'config.model' section; was it written by the train stage?")
    saved = section.get("vocab_size", vocab_size)
    if saved != vocab_size:
        raise CheckpointError(f"{where}: the model was trained with vocabulary size {saved}, but spm.model has "
                              f"{vocab_size} pieces; use the BPE model the run was trained with")
    known = set(TransformerConfig.__dataclass_fields__)
    try:
        return TransformerConfig.from_dict({**{k: v for k, v in section.items() if k in known},
                                            "vocab_size": vocab_size})
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: its model config is not valid for this code: {exc}") from None


def build_model(mf: ModelFile, path: str | Path, *, remedy: str = REMEDY) -> torch.nn.Module:
    """The :class:`model.Transformer` of ``mf`` with its weights loaded (on CPU, train mode).

    Args:
        mf: weights, config and BPE model (from :func:`load`, or assembled from a training checkpoint
            by the evaluate stage).
        path: where the weights came from (named in the error).
        remedy: what to do when they do not fit (default: rebuild ``averaged.pt``).

    Raises:
        CheckpointError: the weights do not fit the config (names ``path`` and ``remedy``).
    """
    from model import Transformer

    try:
        model = Transformer(mf.config)
        model.load_state_dict(mf.weights)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: its weights, config or BPE model do not fit this code ({exc}); "
                              f"{remedy}") from None
    return model


def describe(path: str | Path) -> dict[str, Any] | None:
    """Parameter statistics (floating tensors; a tensor shared by two keys counts once) and the file's
    vocabulary size and width (from its config), or None if the file is absent.

    Returns:
        ``{"total", "embedding", "tied", "learned_positions", "vocab_size", "d_model"}``.

    Raises:
        CheckpointError: unreadable file or not the average stage's format (names the file).
    """
    path = Path(path)
    if not path.is_file():
        return None
    blob = _read(path)
    state, config = blob["model"], blob["config"] if isinstance(blob["config"], dict) else {}
    seen, total = set(), 0
    for tensor in state.values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.is_floating_point() and key not in seen:
            seen.add(key)
            total += tensor.numel()
    embed = state.get("embed.weight")
    shape = tuple(embed.shape) if embed is not None else None
    same_shape = sum(1 for v in state.values() if shape is not None and tuple(v.shape) == shape)
    return {"total": total, "embedding": int(embed.numel()) if embed is not None else 0,
            "tied": embed is not None and same_shape == 1,
            "learned_positions": any("position" in k for k in state),
            "vocab_size": config.get("vocab_size"), "d_model": config.get("d_model")}
