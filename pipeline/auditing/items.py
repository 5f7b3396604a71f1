"""The audit's vocabulary, shared by the paper comparison and the replay: one item, a value as
params.yaml spells it, and the params that never change results."""

from __future__ import annotations

import json
from typing import Any

#: params whose value never changes results (placement, logging, retries, decoding batch budget).
NEUTRAL_KEYS = frozenset({"profile", "paths", "seed", "download.retries", "download.timeout_s", "download.sha256",
                          "encode.shard_rows", "train.keep_last", "train.valid_every_steps", "train.log_every_steps",
                          "evaluate.max_tokens"})


def fmt(value: Any) -> str:
    """A value as params.yaml would spell it (``true``, ``[1, 4]``, ``multi30k``, ``1e-09``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return json.dumps(value)


def item(name: str, *, paper: str, run: str | None, ok: bool | None, deviation: str = "", note: str = "",
         source: str = "") -> dict[str, Any]:
    """One audit line; ``ok`` None means not measured (``run`` then says why)."""
    verdict = "not measured" if ok is None else "matches" if ok else "deviates"
    return {"item": name, "paper": paper, "run": run if run is not None else "not measured", "verdict": verdict,
            "deviation": deviation if verdict == "deviates" else "", "note": note, "source": source}
