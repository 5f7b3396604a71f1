"""The network's configuration and the search limits, importable without torch (``--engine ctranslate2``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

#: Special token ids, defined once: the BPE model is trained with them and the network uses them.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

#: ``field`` metadata of values that are not settings: they come from the BPE model, never from params.
DERIVED = "derived"

#: The widest beam any search here runs. The paper decodes with 4; a search keeps sentences x beam x vocabulary
#: scores per step, so an unbounded beam lets one request take all of a machine's memory.
MAX_BEAM_SIZE = 64
#: The beams a search accepts, as its errors word them.
BEAM_RANGE = f"an integer from 1 to {MAX_BEAM_SIZE} (the widest beam this project searches)"

#: The largest length-penalty exponent a search accepts (params' evaluate.alphas, a served request's alpha): the
#: paper uses 0.6, and ((5 + n) / 6)^alpha overflows a float at alpha ~ 138 for n = 1024 tokens.
MAX_ALPHA = 10.0

#: The beam search rules (``model/beam_rules.py``): fairseq's and tensor2tensor's.
BEAM_RULES = ("fairseq", "t2t")

#: The most weights of a model trained here: at 16 bytes per parameter (fp32 weights, gradients, Adam's moments)
#: 2^32 fill an 80 GB GPU before the first activation. The paper's big model has 213 million.
MAX_WEIGHTS = 2**32


def beam_size_problem(beam_size: object, vocab_size: int = 0) -> str | None:
    """Why a search cannot keep ``beam_size`` hypotheses over ``vocab_size`` pieces (0 = not known), or None."""
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or not 1 <= beam_size <= MAX_BEAM_SIZE:
        return f"must be {BEAM_RANGE}"
    if vocab_size > 0 and beam_size > vocab_size:
        return (f"must be at most the vocabulary size ({vocab_size} pieces): a beam holds one hypothesis "
                "per distinct token")
    return None


def max_length(src_len: int, a: float, b: float) -> int:
    """An output's length limit for a source of ``src_len`` tokens: max(1, floor(a · S + b)) in Python float64."""
    return max(1, math.floor(a * float(src_len) + b))


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Dimensions and special token ids of the Transformer (defaults: the paper's base); ``vocab_size`` 0: unknown."""

    vocab_size: int = field(default=0, metadata={DERIVED: "the BPE model's piece count"})
    d_model: int = 512
    """Width of embeddings and residual stream."""
    n_heads: int = 8
    """Attention heads per attention layer (``d_model`` must be divisible by it)."""
    d_ff: int = 2048
    """Hidden width of the position-wise feed-forward network."""
    n_layers: int = 6
    """Layers in the encoder and (separately) in the decoder."""
    # The paper's §5.4 applies P_drop = 0.1 to each sub-layer's output and the embedding sums only, as do
    # tensor2tensor's transformer_base_v1 and fairseq's transformer_wmt_en_de (attention/activation dropout 0).
    dropout: float = 0.1
    """Dropout on embeddings+positions and on every residual branch (the paper's P_drop)."""
    attn_dropout: float = 0.0
    """Dropout on attention probabilities (0 in the paper; an extension)."""
    ffn_dropout: float = 0.0
    """Dropout on the feed-forward hidden activation (0 in the paper; an extension)."""
    pre_norm: bool = False
    """LayerNorm before each sublayer (plus a final LayerNorm per stack) instead of after (paper)."""
    max_positions: int = 1024
    """Longest sequence the sinusoidal position table covers."""
    pad_id: int = field(default=PAD_ID, metadata={DERIVED: "the BPE model's pad id"})
    """Padding id: masked in attention, zero embedding row, ignored by the loss."""
    bos_id: int = field(default=BOS_ID, metadata={DERIVED: "the BPE model's bos id"})
    """Beginning-of-sentence id: first decoder input token."""
    eos_id: int = field(default=EOS_ID, metadata={DERIVED: "the BPE model's eos id"})
    """End-of-sentence id: appended to sources and targets."""

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.vocab_size, int) or isinstance(self.vocab_size, bool) or self.vocab_size < 0:
            problems.append(f"vocab_size must be an int >= 0 (0 = not known yet), got {self.vocab_size!r}")
        for name in ("d_model", "n_heads", "d_ff", "n_layers", "max_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be a positive int, got {value!r}")
        if not problems and self.d_model % self.n_heads:
            problems.append(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        for name in ("dropout", "attn_dropout", "ffn_dropout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                problems.append(f"{name} must be in [0, 1), got {value!r}")
        ids = {"pad_id": self.pad_id, "bos_id": self.bos_id, "eos_id": self.eos_id}
        for name, value in ids.items():
            bound = self.vocab_size if not problems and self.vocab_size > 0 else 1 << 62
            if not isinstance(value, int) or not 0 <= value < bound:
                problems.append(f"{name} must be an int in [0, vocab_size), got {value!r}")
        if len(set(ids.values())) != 3:
            problems.append(f"pad_id, bos_id and eos_id must differ, got {ids}")
        if problems:
            raise ValueError("invalid TransformerConfig: " + "; ".join(problems))

    def weight_count(self, vocab_size: int | None = None) -> int:
        """The parameters and position-table entries of a model of this config, with ``vocab_size`` (default: own)."""
        d, ff, vocab = self.d_model, self.d_ff, self.vocab_size if vocab_size is None else vocab_size
        attention = 4 * d * d + 4 * d  # q, k, v and output projections with biases
        ffn = 2 * d * ff + ff + d
        encoder = attention + ffn + 2 * 2 * d  # two residual LayerNorms
        decoder = 2 * attention + ffn + 3 * 2 * d
        final_norms = 2 * 2 * d if self.pre_norm else 0
        return vocab * d + self.max_positions * d + self.n_layers * (encoder + decoder) + final_norms

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    def with_vocab(self, vocab_size: int) -> TransformerConfig:
        """This config with ``vocab_size`` set (from the BPE model)."""
        return dataclasses.replace(self, vocab_size=vocab_size)

    def to_dict(self) -> dict[str, int | float | bool]:
        """Plain dict of all fields (JSON/``torch.save(weights_only=True)`` friendly)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, int | float | bool]) -> TransformerConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TransformerConfig keys {unknown}; known keys are {sorted(known)}")
        return cls(**data)
