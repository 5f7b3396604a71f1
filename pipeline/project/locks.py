"""One ``dvc.lock`` per profile: switching profiles puts the live lock aside and brings back the other profile's.

Every output here is ``cache: false`` (folders of GBs, checkpoints), and DVC 3 keeps no run-cache entry for such a
stage, so one shared ``dvc.lock`` would forget a profile's stages whenever another profile ran: going back would
rebuild them. Each profile's outputs live under its own ``paths``, so its last lock still describes them; with it
back, ``dvc repro`` skips every stage that did not change (DVC's "Stage ... didn't change, skipping").
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from pipeline.core.owned import atomic_path, write_text

#: The kept locks, ``<profile>/dvc.lock``, and ``LIVE``: whose lock is live.
KEPT = Path(".dvc") / "tmp" / "nmt-locks"
LOCK = Path("dvc.lock")
log = logging.getLogger(__name__)


def live_owner(root: Path) -> str | None:
    """The profile whose lock is live, as recorded at the last switch (None before the first)."""
    marker = root / KEPT / "LIVE"
    return marker.read_text(encoding="utf-8").strip() or None if marker.is_file() else None


def use_locks(root: str | Path, profile: str | None, before: str | None) -> None:
    """Make the live ``dvc.lock`` ``profile``'s: the live one is kept as its owner's (recorded at the last switch,
    else ``before``: the profile params.yaml held until now, else ``unnamed``), then ``profile``'s kept one comes
    back. A profile with none kept goes on from the live lock: DVC checks each entry's params, deps and outs, so
    it reruns what differs and skips what two profiles share (paper-big's data stages after paper's). Call it under
    the workspace lock, with params.yaml already ``profile``'s (None: a params.yaml of no profile, left alone)."""
    root = Path(root)
    if not (root / ".dvc" / "config").is_file():
        return  # not a DVC project (`dvc init` writes .dvc/config): no lock to keep
    owner = live_owner(root) or before or "unnamed"
    if profile is None or owner == profile:
        if profile is not None:
            write_text(root / KEPT / "LIVE", profile)
        return
    live, mine = root / LOCK, root / KEPT / profile / LOCK
    if kept := live.is_file():
        with atomic_path(root / KEPT / owner / LOCK) as tmp:
            shutil.copyfile(live, tmp)
    if back := mine.is_file():
        with atomic_path(live) as tmp:
            shutil.copyfile(mine, tmp)
    write_text(root / KEPT / "LIVE", profile)
    if kept or back:
        log.info("profile %s: %s kept in %s; %s", owner, LOCK if kept else "no lock", KEPT / owner,
                 f"profile {profile}'s {LOCK} back" if back else f"profile {profile} has no lock yet")
