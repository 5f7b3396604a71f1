"""``audit.md``: the audit mapping (see :func:`pipeline.auditing.report.build_audit`) as markdown tables."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.auditing.items import Item, fmt
from pipeline.auditing.summary import counts_line

if TYPE_CHECKING:
    from pipeline.auditing.replay import Replay
    from pipeline.auditing.report import Audit, Lineage

_MARK = {"matches": "matches", "deviates": "**deviates**", "not measured": "*not measured*",
         "informational": "informational", "warning": "**warning**"}
#: A check's verdicts as the report words them (``matches``: the check passed).
_CHECK_MARK = {**_MARK, "matches": "ok", "deviates": "**fails**"}


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else fmt(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _items(items: list[Item]) -> list[str]:
    rows = [(i["item"], i["paper"], i["run"], (_CHECK_MARK if i["kind"] == "check" else _MARK)[i["verdict"]],
             i["note"], i["source"]) for i in items]
    return _table(("item", "paper", "this run", "verdict", "note", "source"), rows)


def _open(audit: Audit) -> list[str]:
    lines = ["## Settings the paper leaves open", "",
             "They change results, but neither the paper nor the reference implementations fix them: no verdict.", ""]
    rows = [(o["key"], o["run"], o["reference"]) for o in audit["open_settings"]]
    return lines + _table(("key", "this run", "what the references do"), rows)


def _differences(audit: Audit) -> list[str]:
    diffs = audit["profile_differences"]
    lines = ["## Keys that differ from profiles/paper.yaml (informational)", "",
             ("What this profile changes relative to the committed paper profile, beyond the paper settings "
              "judged above (the verdicts compare with the paper, never with this file)."), ""]
    if not diffs:
        return lines + ["None: this is the paper profile.", ""]
    judged = [d["key"] for d in diffs if d["kind"] == "paper"]
    if judged:
        lines += ["Judged by a paper setting (see Deviations and Configuration): " + ", ".join(judged) + ".", ""]
    kinds = {"unspecified": "no paper setting", "operational": "operational (results unchanged)"}
    rows = [(d["key"], d["paper_profile"], d["run"], kinds[d["kind"]]) for d in diffs if d["kind"] != "paper"]
    return lines + (_table(("key", "paper profile", "this run", "kind"), rows) if rows else [])


def _bleu(audit: Audit) -> list[str]:
    lines = ["## BLEU in every signature", ""]
    if audit["bleu_figures"]:
        lines += [f"- {f['set']} `{f['metric']}` = {f['score']:.2f}, signature `{f['signature']}`"
                  for f in audit["bleu_figures"]] + [""]
    else:
        lines += ["Not measured: evaluate.details.json does not exist yet (run `dvc repro evaluate`).", ""]
    gap = audit["bleu_gap"]
    lines += [f"Paper: {audit['paper']['bleu_en_de']} ({audit['paper']['bleu_method']}).", ""]
    if audit["dataset"] != "wmt14":
        lines += [f"The paper's figure and the gap below concern WMT14 newstest2014; this run was tested on "
                  f"{audit['headline']['test_set']} (see the headline).", ""]
    lines += [gap["explanation"], ""]
    lines += [f"- {e['figures']} ({e['source']})" for e in gap["evidence"]]
    return lines + [""]


def _replay(replay: Replay) -> list[str]:
    lines = ["## Replay", "",
             ("Are evaluate.details.json's figures what the hypothesis files on disk score, are those files what "
              "dvc.lock recorded for the evaluate stage, and did the previous evaluation of the same model give the "
              "same BLEU? (`dvc repro -f evaluate` followed by `dvc repro audit` checks a forced re-evaluation.) The "
              "three Replay items are under Run checks."), ""]
    if replay.get("hypotheses_md5"):
        lines += [f"Hypotheses directory md5 (as DVC computes it): `{replay['eval_dir_md5']}`", ""]
        sha = replay.get("hypotheses_sha256") or {}
        lines += _table(("file", "md5", "sha256"), [(rel, md5, sha.get(rel, "not measured"))
                                                     for rel, md5 in replay["hypotheses_md5"].items()])
    return lines


def _lineage(lin: Lineage) -> list[str]:
    git = lin["git"]
    lines = ["## Lineage", "", f"- params.yaml sha256 `{lin['params_sha256']}`",
             f"- git commit `{git['commit']}`, dirty: {fmt(git['dirty'])}" if git["commit"] else
             "- git commit: not measured (not a git checkout)"]
    if git.get("dirty_paths"):
        lines.append("  - modified: " + ", ".join(f"`{p}`" for p in git["dirty_paths"]))
    lines += [f"- newest checkpoint: `{lin['checkpoint_state']}`" if lin["checkpoint_state"] else
              "- newest checkpoint: not measured", ""]
    runs = lin["mlflow_run_ids"]
    lines += ["### MLflow run ids", ""]
    lines += _table(("stage", "run id"), [(k, v or "none (tracking off)") for k, v in runs.items()])
    lines += ["### dvc.lock", ""]
    if lin["dvc_lock"] is None:
        lines += ["Not measured: no dvc.lock.", ""]
    else:
        rows = [(name, f"{kind} {e['path']}", e["md5"]) for name, st in lin["dvc_lock"].items()
                for kind in ("deps", "outs") for e in st[kind]]
        rows += [(name, "stage entry md5 (MLflow tag dvc_lock_md5)", st["lock_md5"]) for name, st in
                 lin["dvc_lock"].items()]
        lines += _table(("stage", "path", "md5"), rows)
    raw = lin["raw_manifest"]
    lines += ["### Raw data manifest", ""]
    if raw is None:
        lines += ["Not measured: no raw manifest.", ""]
    else:
        lines += _table(("split", "lang", "url", "member", "sha256", "lines"),
                        [(f["split"], f["lang"], f["url"], f["member"] or "", f["sha256"], f["lines"])
                         for f in raw["files"]])
        lines += _table(("output", "sha256", "lines"), [(k, v.get("sha256"), v.get("lines"))
                                                        for k, v in sorted((raw["outputs"] or {}).items())])
    shards = lin["shards_manifest"]
    lines += ["### Shards manifest", ""]
    if shards is None:
        return lines + ["Not measured: no shards manifest.", ""]
    lines += [(f"manifest sha256 `{shards['sha256']}`, spm.model sha256 `{shards['spm_sha256']}`, "
               f"vocabulary {shards['vocab_size']}"), ""]
    return lines + _table(("shard", "rows", "sha256"), [(s["path"], s["rows"], s["sha256"])
                                                         for info in shards["splits"].values() for s in info["shards"]])


def listed_above(i: Item) -> bool:
    """Whether an item is already a line of Deviations or Warnings (the detail tables leave it out)."""
    return i["verdict"] in (("warning", "deviates") if i["kind"] == "check" else ("deviates",))


def _summary(audit: Audit) -> list[str]:
    """Headline, counts, warnings and the ranked deviations: the first screen of the report."""
    lines = [f"# Replication audit: profile {audit['profile']} (dataset {audit['dataset']}), compared with "
             f"{audit['paper']['row']}", "", audit["headline"]["text"], "", counts_line(audit["summary"]), "",
             "## Warnings", ""]
    lines += [f"{n}. {w}" for n, w in enumerate(audit["warnings"], start=1)] or ["None."]
    lines += ["", "## Deviations", ""]
    if not audit["deviation_topics"]:
        return lines + ["None.", ""]
    lines += ["From the paper (or its named reference), by expected effect on BLEU; the first three matter most.", ""]
    lines += [_cut(f"- **{n}. {t['topic']}**: {t['text']}", WIDTH)
              for n, t in enumerate(audit["deviation_topics"], start=1)]
    lines += ["", "## Deviations in full", "", "Ranked as above (pipeline/auditing/ranking.py); evidence in brackets.",
              ""]
    lines += [f"{n}. **{t['topic']}**: {t['text']} [{t['why']}]"
              for n, t in enumerate(audit["deviation_topics"], start=1)]
    return lines + [""]


#: The summary's deviation lines fit a terminal this wide (the first screen: under 30 lines).
WIDTH = 120


def _cut(line: str, width: int) -> str:
    """``line``, cut at a ``; `` boundary (or a space) to at most ``width`` characters, ending in `` …`` if cut."""
    if len(line) <= width:
        return line
    head = line[:width - 2]
    stop = head.rfind("; ")
    return (head[:stop] if stop > width // 2 else head[:head.rfind(" ")]) + " …"


def _details(audit: Audit) -> list[str]:
    """The items not listed above: paper and reference settings, measured items, run checks."""
    note = "Items listed under Deviations or Warnings are not repeated here."
    items = audit["configuration"] + audit["measured"] + audit["replay"].get("items", [])
    config = [i for i in audit["configuration"] if not listed_above(i)]
    measured = [i for i in audit["measured"] if i["kind"] != "check" and not listed_above(i)]
    checks = [i for i in items if i["kind"] == "check" and not listed_above(i)]
    lines = ["## Configuration (the paper, §3-§6 and Table 3; where it is silent, the named reference)", "", note, ""]
    lines += _items(config) + ["## Measured", "", note, ""] + _items(measured)
    lines += ["## Run checks (sanity, replay, lineage; counted apart from the paper's items)", "", note, ""]
    return lines + _items(checks)


def render_markdown(audit: Audit) -> str:
    """The whole report as markdown (deterministic for a given audit mapping)."""
    lines = _summary(audit) + _details(audit)
    lines += _open(audit) + _differences(audit) + _bleu(audit) + _replay(audit["replay"])
    env = audit["environment"]
    lines += ["## Environment", ""] + _table(("what", "value"), [(k, "not measured" if v is None else v)
                                                                   for k, v in env.items()])
    return "\n".join(lines + _lineage(audit["lineage"])).rstrip("\n") + "\n"
