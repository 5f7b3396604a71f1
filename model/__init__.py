"""Pure-PyTorch Transformer for NMT: the network, the loss, the schedule and beam search.

Nothing here knows about files, ranks, DVC, Prefect or MLflow.
"""

from model.beam import Hypothesis, beam_search, beam_search_finished, best_hypothesis, length_penalty, max_length
from model.config import TransformerConfig
from model.loss import label_smoothed_nll_loss, label_smoothed_nll_loss_chunked
from model.schedule import inverse_sqrt_lr
from model.transformer import DecoderCache, EncoderOut, Transformer

__all__ = [
    "DecoderCache",
    "EncoderOut",
    "Hypothesis",
    "Transformer",
    "TransformerConfig",
    "beam_search",
    "beam_search_finished",
    "best_hypothesis",
    "inverse_sqrt_lr",
    "label_smoothed_nll_loss",
    "label_smoothed_nll_loss_chunked",
    "length_penalty",
    "max_length",
]
