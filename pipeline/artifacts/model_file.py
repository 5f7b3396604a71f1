"""``averaged.pt`` (weights, config, BPE model, content sha256 checked at every read): its only writer and reader."""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch

from model import TransformerConfig
from pipeline.artifacts import checkpoint, torchfile
from pipeline.core.errors import CheckpointError
from pipeline.core.owned import atomic_path

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
    """``<paths.model>/averaged.pt``."""
    return Path(model_dir) / NAME


def content_sha256(weights: dict[str, torch.Tensor], config: dict[str, int | float | bool], spm: bytes) -> str:
    """Hex sha256 of the tensors (by name), the config and the BPE model, independent of ``torch.save``'s zip."""
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
    """Write the file atomically with its content sha256; equal contents give equal bytes."""
    buffer = io.BytesIO()
    config_dict = config.to_dict()
    torch.save({"model": weights, "config": config_dict, "spm": spm,
                "sha256": content_sha256(weights, config_dict, spm)}, buffer)
    with atomic_path(path) as tmp:
        tmp.write_bytes(buffer.getvalue())


def _read(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    """The file's dict, its format and sha256 checked."""
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
    """Read and check the file (CheckpointError: missing, corrupt, changed since save or of another format)."""
    path = Path(path)
    blob = _read(path, mmap=mmap)
    try:
        config = TransformerConfig.from_dict(blob["config"])
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: its config does not fit this code ({exc}); {REMEDY}") from None
    return ModelFile(weights=blob["model"], config=config, spm=blob["spm"])


def verify(path: str | Path) -> None:
    """Check the file as :func:`load` does, without keeping it (memory-mapped)."""
    _read(Path(path), mmap=True)


def checkpoint_config(folder: str | Path, vocab_size: int) -> TransformerConfig:
    """``state.json``'s ``config.model`` of a checkpoint folder, checked against ``spm.model``'s ``vocab_size``."""
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
    """The :class:`model.Transformer` of ``mf`` on CPU (CheckpointError naming ``path`` if weights do not fit)."""
    from model import Transformer

    try:
        model = Transformer(mf.config)
        model.load_state_dict(mf.weights)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: its weights, config or BPE model do not fit this code ({exc}); "
                              f"{remedy}") from None
    return model


class ModelSummary(TypedDict):
    """What the audit reads of a model file: parameter counts, tying, positions and the config's sizes."""

    total: int  # floating-point parameters, a tensor shared by two keys counted once
    embedding: int  # the shared embedding's
    tied: bool  # embedding and output projection share one tensor
    learned_positions: bool
    vocab_size: int | None
    d_model: int | None


def describe(path: str | Path) -> ModelSummary | None:
    """Parameter counts and sizes of the file (a tensor shared by two keys counts once), or None if absent."""
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
    return ModelSummary(total=total, embedding=int(embed.numel()) if embed is not None else 0,
                        tied=embed is not None and same_shape == 1,
                        learned_positions=any("position" in k for k in state),
                        vocab_size=config.get("vocab_size"), d_model=config.get("d_model"))
