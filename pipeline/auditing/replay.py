"""Audit replay: do the hypothesis files on disk still give evaluate.details.json's figures (rescored with
:mod:`pipeline.inference.scoring`, floats compared exactly), are they the files dvc.lock recorded (md5 recomputed
the way DVC 3 hashes a directory), and did the previous audit of the same model, references and evaluate params
record the same figures and hypotheses? The previous audit.json is an input, so the first audit after an
evaluation differs from the second; from then on an unchanged workspace reproduces its report byte for byte.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TypedDict

from pipeline.auditing.items import NEUTRAL_KEYS, Item, item
from pipeline.core.config import Params, flatten, section_dict
from pipeline.core.details import METRICS, EvaluateDetails, SetFigures
from pipeline.core.errors import PipelineError
from pipeline.core.owned import MARKER
from pipeline.core.stages import DvcLock, LockFile
from pipeline.core.textio import sha256_file
from pipeline.core.yamlfile import PlainMapping
from pipeline.inference.scoring import score_files

SETS = ("valid", "test")
TARGET_LANG = "de"
FIGURES = (*METRICS, "sentences")
HYPOTHESES = {split: f"{split}.hyp.{TARGET_LANG}" for split in SETS}
DVC_CACHE = Path(".dvc") / "cache" / "files" / "md5"
ITEM_RESCORED = "Replay: evaluate.details.json rescored from the hypothesis files"
ITEM_LOCK = "Replay: hypothesis files vs dvc.lock"
ITEM_PREVIOUS = "Replay: BLEU vs the previous evaluation of this model"
_SOURCE = "pipeline/auditing/replay.py"


#: What the replay compares of a scored set: every score of METRICS, ``sentences`` and ``signatures``.
Figures = dict[str, float | int | dict[str, str] | None]


class ReplayRecord(TypedDict):
    """What the next audit compares against (None: not there): the model, the references, the hypotheses, the
    evaluate params and the recorded figures per set."""

    model_sha256: str | None
    evaluate_params: PlainMapping  # the flattened evaluate section, but keys that change no figure
    references_sha256: dict[str, str | None]
    hypotheses_sha256: dict[str, str | None]
    figures: dict[str, Figures] | None


class Replay(TypedDict, total=False):
    """The audit's ``replay`` section (empty without a workspace); None: not measured."""

    items: list[Item]
    record: ReplayRecord
    rescored: dict[str, Figures] | None
    eval_dir_md5: str | None
    hypotheses_md5: dict[str, str] | None
    hypotheses_sha256: dict[str, str] | None


def _item(name: str, *, run: str, ok: bool | None, **more: str) -> Item:
    """A replay check (``ok`` None: ``run`` says why it is not measured)."""
    return item(name, paper="-", run=f"not measured ({run})" if ok is None else run, ok=ok, source=_SOURCE,
                kind="check", **more)


def file_md5(path: Path) -> str:
    """md5 of a file's bytes, as DVC 3 addresses content (not for security)."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "md5").hexdigest()


def dvc_dir_md5(directory: Path) -> tuple[str, dict[str, str]]:
    """DVC 3's md5 of a directory output (``<md5>.dir``) and ``{relpath: md5}`` of each file in it."""
    files = {p.relative_to(directory).as_posix(): file_md5(p) for p in sorted(directory.rglob("*")) if p.is_file()}
    manifest = sorted(({"md5": md5, "relpath": rel} for rel, md5 in files.items()), key=lambda e: e["relpath"])
    blob = json.dumps(manifest, sort_keys=True).encode("utf-8")
    return hashlib.md5(blob).hexdigest() + ".dir", files


def _figures(figures: SetFigures) -> Figures:
    """What the replay compares of a scored set: every score, the sentence count and the signatures."""
    out: Figures = {key: score for key, score in figures.scores().items()}
    out.update(sentences=figures.sentences, signatures=dict(figures.signatures))
    return out


def _differences(recorded: Figures, now: Figures, split: str) -> list[str]:
    """``"<split>.<figure> <recorded> vs <now>"`` for every figure or signature that is not identical."""
    out = [f"{split}.{key} {recorded.get(key)!r} vs {now.get(key)!r}" for key in FIGURES
           if recorded.get(key) != now.get(key)]
    sig_a, sig_b = _signatures(recorded), _signatures(now)
    out += [f"{split} signature {key} {sig_a.get(key)!r} vs {sig_b.get(key)!r}"
            for key in sorted(set(sig_a) | set(sig_b)) if sig_a.get(key) != sig_b.get(key)]
    return out


def _signatures(figures: Figures) -> dict[str, str]:
    """The signatures of ``figures`` (none when a file recorded none)."""
    found = figures.get("signatures")
    return found if isinstance(found, dict) else {}


def rescore(bleu: EvaluateDetails | None, eval_dir: Path, raw_dir: Path) -> tuple[Item, dict[str, Figures] | None]:
    """The rescoring item and the rescored figures per set (None when not measured)."""
    if bleu is None:
        return _item(ITEM_RESCORED, run="no evaluate.details.json: run `dvc repro evaluate`", ok=None), None
    pairs = {split: (eval_dir / HYPOTHESES[split], raw_dir / f"{split}.{TARGET_LANG}") for split in SETS}
    missing = [str(p) for pair in pairs.values() for p in pair if not p.is_file()]
    if missing:
        return _item(ITEM_RESCORED, run=f"missing {', '.join(missing)}", ok=None), None
    rescored: dict[str, Figures] = {}
    diffs: list[str] = []
    for split, (hyp, ref) in pairs.items():
        try:
            rescored[split] = _figures(score_files(hyp, ref, TARGET_LANG))
        except PipelineError as exc:  # a truncated or corrupted hypothesis file is what this item reports
            diffs.append(f"{split}: cannot be rescored: {exc}")
            continue
        diffs += _differences(_figures(getattr(bleu, split)), rescored[split], split)
    note = "evaluate.details.json vs rescored; floats compared exactly"
    return _item(ITEM_RESCORED, run="reproduced exactly" if not diffs else "differs", ok=not diffs,
                 deviation="differs: " + "; ".join(diffs), note=note), rescored


def _lock_out(lock: DvcLock | None, eval_path: str) -> tuple[LockFile | None, str]:
    """dvc.lock's entry for the evaluate stage's ``eval_path`` output, or None and why not."""
    if lock is None:
        return None, "no dvc.lock"
    entry = (lock.get("stages") or {}).get("evaluate")
    if entry is None:
        return None, "dvc.lock has no evaluate stage: run `dvc repro evaluate`"
    want = eval_path.rstrip("/").removeprefix("./")
    for out in entry.get("outs") or []:
        if str(out.get("path", "")).rstrip("/").removeprefix("./") == want:
            return out, ""
    paths = ", ".join(str(o.get("path")) for o in entry.get("outs") or []) or "none"
    return None, f"dvc.lock's evaluate stage records outs {paths}, not {want}: run `dvc repro evaluate`"


def _cache_manifest(root: Path, dir_md5: str) -> dict[str, str] | None:
    """``{relpath: md5}`` from the DVC cache's ``.dir`` manifest, or None when it is absent or unreadable."""
    path = root / DVC_CACHE / dir_md5[:2] / dir_md5[2:]
    try:
        return {e["relpath"]: e["md5"] for e in json.loads(path.read_text(encoding="utf-8"))}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def lock_check(lock: DvcLock | None, root: Path, eval_path: str,
               current: tuple[str, dict[str, str]] | None) -> Item:
    """The dvc.lock item: the hypotheses directory's DVC md5 now vs the one the evaluate stage recorded."""
    out, why = _lock_out(lock, eval_path)
    if current is None:
        why = f"{eval_path} does not exist"
    if out is None or current is None:
        return _item(ITEM_LOCK, run=why, ok=None)
    recorded, (now, files) = str(out.get("md5")), current
    note = "md5 recomputed the way DVC 3 hashes a directory"
    if recorded == now:
        return _item(ITEM_LOCK, run=f"identical (md5 {now})", ok=True, note=note)
    manifest = _cache_manifest(root, recorded)
    if manifest is None:
        detail = "no manifest of the recorded md5 in .dvc/cache to name the files"
    else:
        changed = sorted(rel for rel in set(manifest) | set(files) if manifest.get(rel) != files.get(rel))
        detail = "changed: " + ", ".join(changed)
    return _item(ITEM_LOCK, run=f"differs (md5 {now})", ok=False, note=note,
                 deviation=f"differs: {eval_path} md5 {now} vs {recorded} in dvc.lock ({detail})")


def record(params: Params, bleu: EvaluateDetails | None, model_path: Path, eval_dir: Path,
           raw_dir: Path) -> ReplayRecord:
    """What the next audit compares against: model, references, hypotheses, evaluate params, figures."""
    def sha(path: Path) -> str | None:
        return sha256_file(path) if path.is_file() else None

    evaluate = {k: v for k, v in flatten({"evaluate": section_dict(params.evaluate)}).items() if k not in NEUTRAL_KEYS}
    return ReplayRecord(model_sha256=sha(model_path), evaluate_params=evaluate,
                        references_sha256={s: sha(raw_dir / f"{s}.{TARGET_LANG}") for s in SETS},
                        hypotheses_sha256={name: sha(eval_dir / name) for name in HYPOTHESES.values()},
                        figures=None if bleu is None else {s: _figures(getattr(bleu, s)) for s in SETS})


def previous_check(now: ReplayRecord, previous: Replay | None) -> Item:
    """The previous-evaluation item: same model, references and params → identical figures and hypotheses."""
    figures, model_sha256 = now["figures"], now["model_sha256"]
    if figures is None or model_sha256 is None:
        return _item(ITEM_PREVIOUS, run="no evaluate.details.json or no averaged.pt", ok=None)
    before = (previous or {}).get("record")
    if not isinstance(before, dict) or before.get("figures") is None:
        return _item(ITEM_PREVIOUS, run="no previous audit recorded an evaluation", ok=None)
    for differs, what in ((before.get("model_sha256") != model_sha256, "another averaged model"),
                          (before.get("references_sha256") != now["references_sha256"], "other references"),
                          (before.get("evaluate_params") != now["evaluate_params"], "other evaluate params")):
        if differs:
            return _item(ITEM_PREVIOUS, run=f"the previous audit recorded {what}", ok=None)
    diffs = [d for s in SETS for d in _differences(before["figures"].get(s) or {}, figures[s], s)]
    hyp_before, hyp_now = before.get("hypotheses_sha256") or {}, now["hypotheses_sha256"]
    diffs += [f"{name} sha256 {hyp_before.get(name)} vs {hyp_now[name]}" for name in sorted(hyp_now)
              if hyp_before.get(name) != hyp_now[name]]
    return _item(ITEM_PREVIOUS, run="differs" if diffs else "replayed: identical to the previous evaluation",
                 ok=not diffs, deviation="differs: " + "; ".join(diffs),
                 note=f"same averaged.pt (sha256 {model_sha256[:12]}), references and evaluate params")


def replay(*, params: Params, bleu: EvaluateDetails | None, lock: DvcLock | None, root: Path,
           previous: Replay | None) -> Replay:
    """The audit's ``replay`` section for the workspace ``root``; missing inputs are None."""
    paths = params.paths
    eval_dir, raw_dir = root / paths.eval, root / paths.raw
    model_path = root / paths.model / "averaged.pt"
    rescored_item, rescored = rescore(bleu, eval_dir, raw_dir)
    current = dvc_dir_md5(eval_dir) if eval_dir.is_dir() else None
    now = record(params, bleu, model_path, eval_dir, raw_dir)
    items = [rescored_item, lock_check(lock, root, str(paths.eval), current), previous_check(now, previous)]
    files = {rel: md5 for rel, md5 in current[1].items() if rel != MARKER} if current else None  # MARKER: no hyp
    return {"items": items, "record": now, "rescored": rescored,
            "eval_dir_md5": current[0] if current else None, "hypotheses_md5": files,
            "hypotheses_sha256": {rel: sha256_file(eval_dir / rel) for rel in files} if files else None}
