"""What the torch and CTranslate2 engines share, importing neither: ``--device`` values, sources, detokenising."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from model.config import TransformerConfig
from pipeline.core.errors import PipelineError

_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")


def parse_device(spec: str, option: str = "--device") -> tuple[str, int | None]:
    """``cpu``, ``cuda`` or ``cuda:N`` → (type, index or None); anything else is a PipelineError naming ``option``."""
    match = _DEVICE.fullmatch(spec.strip())
    if match is None or (match[1] == "cpu" and match[2] is not None):
        raise PipelineError(f"{option} {spec}: not a device; use cpu, cuda or cuda:N (N = 0 for the first GPU)")
    return match[1], None if match[2] is None else int(match[2])


def check_cuda(spec: str, index: int | None, count: int, *, option: str = "--device", library: str = "torch",
               probe: str = "torch.cuda.is_available() is False") -> None:
    """Refuse a CUDA device this machine lacks (``count``: the devices ``library`` sees), naming ``option``."""
    if count < 1:
        raise PipelineError(f"{option} {spec}: this {library} build sees no CUDA device ({probe}); "
                            f"use {option} cpu or leave {option} out")
    if index is not None and index >= count:
        raise PipelineError(f"{option} {spec}: this machine has {count} CUDA device(s), cuda:0 .. cuda:{count - 1}; "
                            f"use one of them or leave {option} out")


def prepare_source(ids: Sequence[int], config: TransformerConfig) -> tuple[list[int], bool]:
    """BPE ids → (model source: ids + EOS cut to ``max_positions``, or ``[]`` without ids; whether it was cut)."""
    ids = [int(i) for i in ids]
    if not ids:
        return [], False
    limit = config.max_positions - 1
    truncated = len(ids) > limit
    return ids[:limit] + [config.eos_id], truncated


def detokenize(sp: Any, hyps: Sequence[Sequence[int]]) -> list[str]:
    """SentencePiece ids → text with ``sp``, one line per hypothesis (``[]`` → ``""``)."""
    return [sp.decode([int(t) for t in h]).replace("\n", " ") if h else "" for h in hyps]
