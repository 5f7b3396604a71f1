"""The audit's vocabulary, shared by the paper comparison and the replay: one item, a value as
params.yaml spells it, and the params that never change results."""

from __future__ import annotations

import json
from typing import Any, TypedDict

#: params that never change what the audit judges (``train.max_minutes`` pauses a run that resumes when rerun;
#: the measured item "Sources cut at max_positions" says when the position table binds).
NEUTRAL_KEYS = frozenset({"profile", "paths", "seed", "download.retries", "download.timeout_s", "download.sha256",
                          "bpe.seed", "encode.shard_rows", "model.max_positions", "train.max_minutes",
                          "train.keep_last", "train.valid_every_steps", "train.log_every_steps",
                          "evaluate.max_tokens"})

#: ``informational``: context, no verdict; ``warning``: not a deviation, but something to look at (its note).
VERDICTS = ("matches", "deviates", "not measured", "informational", "warning")

#: What an item is judged against: the paper, a reference implementation where it is silent, or a ``check`` of
#: the run itself (``matches``: passed, ``deviates``: failed). Matches are counted per kind.
KINDS = ("paper", "reference", "check")


def neutral(key: str) -> bool:
    """Whether a dotted params key is (under) one of :data:`NEUTRAL_KEYS`."""
    return key in NEUTRAL_KEYS or key.split(".")[0] in NEUTRAL_KEYS


def fmt(value: Any) -> str:
    """A value as params.yaml would spell it (``true``, ``[1, 4]``, ``multi30k``, ``1e-09``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return json.dumps(value)


class Item(TypedDict):
    """One audit line as audit.json holds it (``deviation`` set only when the verdict is ``deviates``)."""

    item: str
    kind: str
    paper: str
    run: str
    verdict: str
    deviation: str
    note: str
    source: str


def item(name: str, *, paper: str, run: str | None, ok: bool | None, deviation: str = "", note: str = "",
         source: str = "", verdict: str | None = None, kind: str = "paper") -> Item:
    """One audit line; ``ok`` None means not measured; ``verdict`` (informational, warning) overrides ``ok``."""
    if verdict is None or run is None:
        verdict = "not measured" if ok is None else "matches" if ok else "deviates"
    return {"item": name, "kind": kind, "paper": paper, "run": run if run is not None else "not measured",
            "verdict": verdict, "deviation": deviation if verdict == "deviates" else "", "note": note,
            "source": source}
