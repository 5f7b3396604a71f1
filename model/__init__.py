"""Pure-PyTorch Transformer for NMT: the network, the loss, the schedule and beam search.
Names are imported on first use (PEP 562), so ``model.config`` can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Public name -> the module defining it.
_LAZY = {
    "DecoderState": "model.transformer", "EncoderOut": "model.transformer", "Transformer": "model.transformer",
    "Hypothesis": "model.beam_rules", "beam_search": "model.beam", "beam_search_finished": "model.beam",
    "best_hypothesis": "model.beam_rules", "length_penalty": "model.beam_rules",
    "TransformerConfig": "model.config", "max_length": "model.config",
    "label_smoothed_nll_loss": "model.loss", "label_smoothed_nll_loss_lean": "model.loss",
    "autocast": "model.precision", "inverse_sqrt_lr": "model.schedule",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    from model.beam import beam_search, beam_search_finished
    from model.beam_rules import Hypothesis, best_hypothesis, length_penalty
    from model.config import TransformerConfig, max_length
    from model.loss import label_smoothed_nll_loss, label_smoothed_nll_loss_lean
    from model.precision import autocast
    from model.schedule import inverse_sqrt_lr
    from model.transformer import DecoderState, EncoderOut, Transformer


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
