"""Deviations grouped by topic (a configured value and what the run measured from it are one line) and ranked
by expected effect on BLEU: the order of :data:`TOPICS`. Each topic's ``why`` is the evidence printed beside it:
the paper's Table 3 ablations, or Popel and Bojar 2018 ("Training Tips for the Transformer Model",
arXiv:1804.00247).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from pipeline.auditing.dev_items import NEWEST
from pipeline.auditing.items import Item


@dataclass(frozen=True)
class Topic:
    """A group of items that together make one deviation; ``why`` is the evidence for its rank."""

    name: str
    why: str
    items: tuple[str, ...]


POPEL = "Popel and Bojar 2018, arXiv:1804.00247"
TOPICS: tuple[Topic, ...] = (
    Topic("Training data", "the corpus fixes domain, size and test set (§5.1)",
          ("Dataset", "Training pairs (downloaded)")),
    Topic("Model size", "Table 3 (C): N=2 23.7, d_model 256 24.5, d_ff 1024 25.4 dev BLEU vs 25.8",
          ("Layers N (encoder, decoder)", "d_model", "d_ff", "Attention heads h", "d_k = d_v", "Parameters")),
    Topic("Training length", f"Table 3: big at 300k steps 26.4; {POPEL}",
          ("Training steps", "Steps trained", "Target tokens trained", "Epoch limit")),
    Topic("Batch size", POPEL, ("Tokens per step", "Target tokens per step", "Source tokens per step")),
    Topic("Learning-rate schedule", POPEL, ("Learning-rate formula", "Warmup steps")),
    Topic("Regularisation", "Table 3 (D): no dropout 24.6, no label smoothing 25.3 dev BLEU",
          ("Residual dropout P_drop", "Attention-weight dropout", "FFN hidden dropout", "Label smoothing ε_ls")),
    Topic("Vocabulary", "not varied in the paper", ("Shared BPE vocabulary", "BPE vocabulary (built)",
                                                    "BPE training text", "BPE character coverage")),
    Topic("Architecture details", "Table 3 (E): learned positions 25.7 dev BLEU",
          ("Normalisation", "Tied embeddings", "Positions", "Attention projection biases")),
    Topic("Optimiser", "not varied in the paper", ("Adam β1, β2, ε", "Weight decay", "Gradient clipping")),
    Topic("Data filtering and lengths", "changes the training pairs and tokens at the margin",
          ("Training-pair length filter", "Training-pair length ratio", "Maximum training length",
           "Sources cut at max_positions")),
    Topic("Decoding", "beam and α tuned on dev (§6.1)",
          ("Beam size", "Length penalty α", "Beam search rule", "Maximum output length", "Decoding used")),
    Topic("Checkpoint averaging", "§6.1", ("Checkpoint interval", "Checkpoints averaged")),
    Topic("Numerics", "bf16 rounds activations; the demo's losses stayed within 0.7% of fp32 (benchmarks/RESULTS.md)",
          ("Training precision",)),
    Topic("Compute", "changes training time, not the result at equal steps and batch",
          ("Training time", "Hardware", "GPU-hours")),
    Topic("Dev-set results", "outcomes, not causes",
          (f"BLEU, paper's method (tok+split), valid, {NEWEST}", f"Perplexity per BPE token, valid, {NEWEST}")),
)


class TopicLine(TypedDict):
    """A line of the deviation list: the topic's ``rank`` in :data:`TOPICS`, its deviating items, one ``text``."""

    rank: int
    topic: str
    why: str
    items: list[str]
    text: str


#: Items shown in the headline (test BLEU), never in the deviation list.
HEADLINE_ITEMS = ("BLEU, paper's method (tok+split), test", "BLEU, sacreBLEU 13a, test")
TOPIC_OF: dict[str, Topic] = {name: topic for topic in TOPICS for name in topic.items}


def deviation_topics(configured: list[Item], measured: list[Item]) -> list[TopicLine]:
    """One entry per topic with a deviating paper or reference item, most expected effect on BLEU first.

    Raises:
        KeyError: a deviating item belongs to no topic (a new item needs one in :data:`TOPICS`).
    """
    grouped: dict[str, tuple[list[str], list[str], list[str]]] = {}
    for source, i in [(0, i) for i in configured] + [(1, i) for i in measured]:
        if i["verdict"] == "deviates" and i["kind"] != "check" and i["item"] not in HEADLINE_ITEMS:
            names, conf, meas = grouped.setdefault(TOPIC_OF[i["item"]].name, ([], [], []))
            names.append(i["item"])
            (meas if source else conf).append(i["deviation"])
    out: list[TopicLine] = []
    for rank, topic in enumerate(TOPICS, start=1):
        if topic.name in grouped:
            names, conf, meas = grouped[topic.name]  # configured deviations first, then what the run measured
            text = "; ".join(conf) + ("; measured: " if conf and meas else "") + "; ".join(meas)
            out.append({"rank": rank, "topic": topic.name, "why": topic.why, "items": names, "text": text})
    return out
