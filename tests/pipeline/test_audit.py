"""Stage ``audit``: a tiny run made by the real stages (clean → bpe → encode → train → average → evaluate)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipeline import audit
from pipeline.auditing.paper import minor_items
from pipeline.auditing.settings import PAPER_SETTINGS
from pipeline.core import stages
from pipeline.core.config import Params, checkpoint_folder, flatten, params_from_dict
from pipeline.core.details import METRICS, RECORDS, Record, RunDetails
from pipeline.core.errors import CheckpointError, DataError, PipelineError
from pipeline.core.owned import write_text
from pipeline.project.profiles import merged_profile
from tests.helpers.audit_world import missing_repository_files, profile_params
from tests.helpers.paths import REPO


def _audit(root: Path, params: Params, params_file: Path | None = None) -> dict:
    """Run the audit stage; return the audit it wrote (the stage itself returns its metrics)."""
    audit.stage(params, params_file=params_file or root / "params.yaml", lock_file=root / "dvc.lock",
                root=root, md_path=root / "data" / "reports" / "audit.md", json_path=root / "data" / "reports" / "audit.json")
    return json.loads((root / "data" / "reports" / "audit.json").read_text(encoding="utf-8"))


def _copy(world: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    shutil.copytree(world, root)
    return root


def _by_item(report: dict) -> dict[str, dict]:
    return {i["item"]: i for i in report["configuration"] + report["measured"]}


def _unknown(record: Record, where: str = "") -> list[str]:
    """The keys of ``record``, and of the records nested in it, that their classes do not declare."""
    found = [f"{where}{key}" for key in record.extra]
    for name in type(record).model_fields:
        value = getattr(record, name)
        values = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        found += [key for v in values if isinstance(v, Record) for key in _unknown(v, f"{where}{name}.")]
    return found


def test_the_real_stages_write_only_the_fields_their_records_declare(audit_world: Path) -> None:
    metrics = audit_world / "data" / "metrics"
    for name in ("download", "clean", "bpe", "encode", "train", "average", "evaluate"):
        data = json.loads(stages.details_file(metrics, name).read_text(encoding="utf-8"))
        assert set(data) == set(RECORDS[name].model_fields) or name == "download", name  # download: a stand-in
        assert _unknown(RECORDS[name].from_json(data, name)) == [], name


@pytest.mark.slow
def test_tiny_run_audit_measures_everything_and_names_every_changed_key(audit_world: Path, tmp_path: Path) -> None:
    root = _copy(audit_world, tmp_path)
    data, params, _ = profile_params("tiny", root)
    report = _audit(root, params)
    assert json.loads((root / "data" / "reports" / "audit.json").read_text()) == report
    md = (root / "data" / "reports" / "audit.md").read_text()
    items = _by_item(report)
    train = json.loads((root / "data" / "metrics" / "train.details.json").read_text())
    # GPU-hours exist only for CUDA runs; a CPU run says "not measured" there.
    device_items = ("GPU-hours",) if train.get("device") == "cpu" else ("Hardware", "GPU-hours")
    assert all(i["verdict"] != "not measured" for i in report["measured"] if i["item"] not in device_items), \
        [i["item"] for i in report["measured"] if i["verdict"] == "not measured"]
    # every key the tiny profile changes is listed (informational); the deviations come from the paper's
    # values, each key that differs from them named, with the reference where the paper is silent
    changed = {k for k, v in flatten(data).items() if flatten(merged_profile("paper", REPO)).get(k) != v}
    assert {d["key"] for d in report["profile_differences"]} == changed
    text = "\n".join(report["deviations"])
    for diff in report["profile_differences"]:
        if diff["kind"] == "paper" and diff["paper_verdict"] == "deviates":
            assert f": {diff['key']} = " in text or f"; {diff['key']} = " in text, diff["key"]
    assert "paper profile" not in text
    assert "model.pre_norm" not in text  # tiny keeps post-norm
    assert "train.warmup_steps = 5 (paper: 4000)" in text
    assert "Training data: download.dataset = multi30k (paper: WMT14 EN-DE (~4.5M pairs))" in text
    assert "bpe.vocab_size = 300 (paper: ~37,000 shared source-target BPE)" in text
    assert "encode.max_len = 64 (tensor2tensor transformer_base_v1: 256 subword tokens per side)" in text
    # the first screen: headline, counts, warnings, the three deviations that matter most; files that exist
    head = md.splitlines()[:30]
    assert head[2] == report["headline"]["text"] and "Multi30k test_2016_flickr" in head[2]
    assert all(f"{n}. {w}" in head for n, w in enumerate(report["warnings"], start=1))
    assert [t["topic"] for t in report["deviation_topics"][:3]] == ["Training data", "Model size", "Training length"]
    assert sum(line.startswith(("- **1. ", "- **2. ", "- **3. ")) for line in head) == 3
    assert missing_repository_files(md) == [] and "pipeline/auditing/replay.py" in md
    # the flow's run report quotes the Deviations bullets: the first bullet of audit.md is the first deviation
    assert next(line for line in md.splitlines() if line.startswith("- ")).startswith("- **1. Training data**: ")
    # measured beside configured: tokens per step from train.json, averaging span, the newest checkpoint on valid
    per_step = items["Target tokens per step"]
    assert per_step["run"] == f"{train['tokens_per_step_mean']:,.0f}" and "std " in per_step["note"]
    assert per_step["verdict"] == "deviates" and "params train.tokens_per_step = 1024" in per_step["note"]
    assert items["World size"]["verdict"] == items["Forward passes per step"]["verdict"] == "informational"
    assert items["Averaging span"]["run"].startswith("2 checkpoint(s), steps 18-20: the last 10.0% of training")
    assert (items["Averaging span"]["verdict"], items["Averaging span"]["note"]) == (
        "warning", "2 checkpoint(s) averaged (paper: 5)")
    assert "Averaging span: 2 checkpoint(s) averaged (paper: 5)" in report["warnings"]
    newest = items["BLEU, paper's method (tok+split), valid, newest checkpoint"]
    bleu = json.loads((root / "data" / "metrics" / "evaluate.details.json").read_text())
    assert newest["run"] == f"{bleu['valid_newest']['bleu_tok_split']:.2f}"
    assert newest["verdict"] == "informational" and "multi30k valid set, not newstest2013" in newest["note"]
    assert items["Averaged vs newest checkpoint, valid BLEU"]["verdict"] in ("matches", "warning")
    assert items["Sources cut at max_positions"]["verdict"] == "matches"
    # parameter count: the averaged model's parameters, the tied embedding once
    model = torch.load(root / "data" / "model" / "averaged.pt", weights_only=True)
    from model import Transformer, TransformerConfig

    expected = sum(p.numel() for p in Transformer(TransformerConfig.from_dict(model["config"])).parameters())
    assert items["Parameters"]["run"].startswith(f"{expected:,} ")
    assert items["Parameters"]["verdict"] == "deviates" and items["Tied embeddings"]["verdict"] == "matches"
    assert items["Steps trained"]["run"] == "20"
    assert items["Target tokens trained"]["run"] == f"{train['tokens_seen']:,}"
    # BLEU: every figure with its signature, beside the paper's; multi30k is not comparable
    figures = {(f["set"], f["metric"]): f for f in report["bleu_figures"]}
    for split in ("test", "valid", "valid_newest"):
        for key, sig in bleu[split]["signatures"].items():
            assert figures[(split, key)]["score"] == bleu[split][key] and figures[(split, key)]["signature"] == sig
            assert sig in md
    tok = items["BLEU, paper's method (tok+split), test"]
    assert tok["verdict"] == "informational" and "multi30k test set, not newstest2014" in tok["note"]
    assert "0.7-1.4 points" in md and "tensor2tensor/issues/61" in md and "scaling_nmt/README.md" in md
    assert items["Lineage consistency"]["verdict"] == "matches", items["Lineage consistency"]["deviation"]
    assert report["environment"]["torch"] == torch.__version__
    newest = next(line for line in md.splitlines() if line.startswith("| valid.newest.hyp.de |"))
    assert re.search(r"\| [0-9a-f]{64} \|$", newest), newest  # every hypothesis file's sha256, not only the averaged's
    machine = f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    for stage in ("train", "evaluate"):  # the CPU each stage's figures came from (its model, vector unit, threads)
        assert report["environment"][f"{stage}_machine"].endswith(machine) and f"| {stage}_machine |" in md


def test_lineage_repeats_dvc_lock_manifests_params_and_run_ids(audit_world: Path, tmp_path: Path) -> None:
    root = _copy(audit_world, tmp_path)
    _, params, params_file = profile_params("tiny", root)
    lineage = _audit(root, params)["lineage"]
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    assert sorted(lineage["dvc_lock"]) == sorted(lock["stages"])
    for name, entry in lock["stages"].items():
        got = lineage["dvc_lock"][name]
        assert got["deps"] == [{"path": d["path"], "md5": d["md5"]} for d in entry["deps"]]
        assert got["outs"] == [{"path": o["path"], "md5": o["md5"]} for o in entry["outs"]]
        assert got["lock_md5"] == stages.lock_md5(lock, name)
    raw = json.loads((root / "data" / "raw" / "manifest.json").read_text())
    assert [f["sha256"] for f in lineage["raw_manifest"]["files"]] == [f["sha256"] for f in raw["files"]]
    assert lineage["raw_manifest"]["outputs"] == raw["outputs"]
    shards = json.loads((root / "data" / "shards" / "manifest.json").read_text())
    assert lineage["shards_manifest"]["sha256"] == hashlib.sha256((root / "data" / "shards" / "manifest.json").read_bytes()
                                                                  ).hexdigest()
    for split, info in shards["splits"].items():
        assert [s["sha256"] for s in lineage["shards_manifest"]["splits"][split]["shards"]] == \
            [s["sha256"] for s in info["shards"]]
    assert lineage["params_sha256"] == hashlib.sha256(params_file.read_bytes()).hexdigest()
    assert set(lineage["mlflow_run_ids"]) >= set(stages.NAMES) - {"register", "audit"}
    assert lineage["git"] == {"commit": None, "dirty": None, "dirty_paths": []}
    assert lineage["checkpoint_state"] == f"{checkpoint_folder(params)}/step-00000020/state.json"


def _no_nulls(value: object) -> object:
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    return [_no_nulls(v) for v in value] if isinstance(value, list) else value


def test_the_stages_details_read_into_their_records_and_back(audit_world: Path) -> None:
    """The records read what the real stages write (pipeline/core/details.py), typed, and lose no key."""
    metrics = audit_world / "data" / "metrics"
    details = RunDetails.read(metrics)
    assert details.written == set(stages.NAMES) - {"register", "audit"}
    for name in details.written:
        record, written = getattr(details, name), json.loads(stages.details_file(metrics, name).read_text())
        assert type(record).from_json(record.to_json(), name) == record
        assert _no_nulls(record.to_json()) == _no_nulls(written), name
    train, average, evaluate = details.train, details.average, details.evaluate
    assert train.step == 20 and train.device == "cpu" and train.valid_ppl and train.tokens_per_step_mean
    assert average.steps[-1] == 20 and average.parameters and average.spm_sha256 == details.bpe.spm_sha256
    assert evaluate.test.bleu is not None and set(evaluate.test.signatures) == set(METRICS)
    assert evaluate.valid_newest.step == 20 and evaluate.valid.ppl and evaluate.chosen.chosen_on == "valid"
    assert details.clean.train.pairs_out and details.download.pairs["train"] == details.clean.train.pairs_in


def test_stale_and_inconsistent_lineage_is_named(audit_world: Path, tmp_path: Path) -> None:
    root = _copy(audit_world, tmp_path)
    data, _, _ = profile_params("tiny", root)
    data["train"]["warmup_steps"] = 7  # params changed after the run
    write_text(root / "params.yaml", yaml.safe_dump(data, sort_keys=False))
    manifest = root / "data" / "shards" / "manifest.json"
    manifest.write_text(manifest.read_text() + " ")
    report = _audit(root, params_from_dict(data))
    item = _by_item(report)["Lineage consistency"]
    assert item["verdict"] == "deviates" and item["kind"] == "check"
    assert f"Lineage consistency: {item['deviation']}" in report["warnings"]  # a failed check warns, once
    assert report["summary"]["checks"]["deviates"] == 1 and item["deviation"] not in "\n".join(report["deviations"])
    assert "dvc.lock stage train ran with other params (train.warmup_steps 5 -> 7)" in item["deviation"]
    trained_in = checkpoint_folder(params_from_dict(yaml.safe_load((audit_world / "params.yaml").read_text())))
    assert f"{trained_in}/step-00000020/state.json was trained on shards manifest" in item["deviation"]
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    lock["stages"]["bpe"]["outs"] = [{"path": "data/other/bpe", "md5": "0" * 32}]  # another profile's entry
    (root / "dvc.lock").write_text(yaml.safe_dump(lock))
    item = _by_item(_audit(root, params_from_dict(data)))["Lineage consistency"]
    assert "dvc.lock stage bpe records other paths (data/other/bpe), not this profile's" in item["deviation"]


@pytest.mark.parametrize("name", ["tiny", "demo"])
def test_every_key_a_profile_changes_is_named_even_before_anything_ran(tmp_path: Path, name: str) -> None:
    data, params, _ = profile_params(name, tmp_path)
    report = _audit(tmp_path, params)
    paper = flatten(merged_profile("paper", REPO))
    changed = {k for k, v in flatten(data).items() if paper.get(k) != v}
    assert {d["key"] for d in report["profile_differences"]} == changed  # listed, for information
    text = "\n".join(report["deviations"])
    for diff in report["profile_differences"]:
        if diff["kind"] == "paper":  # a paper setting covers it: its verdict, not the profile, decides
            assert diff["paper_verdict"] in ("matches", "deviates"), diff
            assert (diff["paper_verdict"] == "deviates") == (f"{diff['key']} = " in text), diff["key"]
    assert "paper profile" not in text
    assert all(i["verdict"] == "not measured" for i in report["measured"])
    assert report["lineage"]["dvc_lock"] is None and report["bleu_figures"] == []
    md = (tmp_path / "data" / "reports" / "audit.md").read_text()
    assert "Not measured: evaluate.details.json does not exist yet" in md and "Not measured: no dvc.lock." in md
    assert [key for key in changed - {"profile"} if key not in md] == []  # every changed key named, once judged
    if name == "demo":
        lr_scale = data["train"]["lr_scale"]
        for expected in (f"train.lr_scale = {lr_scale} (paper: lrate", "train.warmup_steps = 200 (paper: 4000)",
                         "bpe.vocab_size = 8000 (paper: ~37,000", "download.dataset = multi30k (paper: WMT14"):
            assert expected in text, expected
        assert "train.max_minutes" not in text  # it pauses a run, which resumes: the model is the same


def test_paper_profile_deviates_only_in_the_length_filters_unit(tmp_path: Path) -> None:
    """fairseq's numbers (1-250, ratio 1.5) counted in words of the raw text, not BPE tokens: the one deviation."""
    _, params, _ = profile_params("paper", tmp_path)
    report = _audit(tmp_path, params)
    assert [i["item"] for i in report["configuration"] if i["verdict"] not in ("matches", "informational")] == [
        "Training-pair length filter", "Training-pair length ratio"]
    assert [d.split(":")[0] for d in report["deviations"]] == ["Data filtering and lengths"]
    assert [d for d in report["profile_differences"]] == \
        [d for d in report["profile_differences"] if d["key"].startswith("paths.")]
    assert {s.name for s in PAPER_SETTINGS} | {i["item"] for i in minor_items()} == \
        {i["item"] for i in report["configuration"]}
    assert report["warnings"] == [] and report["summary"]["warnings"] == 0
    md = (tmp_path / "data" / "reports" / "audit.md").read_text()
    assert "\n\n- **1. Data filtering and lengths**: min_words 1, max_words 250 in whitespace words" in md
    assert "## Warnings\n\nNone." in md
    assert "(informational)" in md and "## Settings the paper leaves open" in md


@pytest.mark.parametrize("profile_dropout", [0.1, 0.0])
def test_dropouts_are_judged_against_the_paper_whatever_the_paper_profile_says(tmp_path: Path,
                                                                               profile_dropout: float) -> None:
    """attn/ffn dropout 0.1 deviates from the paper (§5.4: sub-layer outputs and embedding sums only), even
    when profiles/paper.yaml itself says 0.1 (the audit reads the workspace's profiles/ first)."""
    data, _, _ = profile_params("paper", tmp_path)
    profile = {**data, "model": {**data["model"], "attn_dropout": profile_dropout, "ffn_dropout": profile_dropout}}
    write_text(tmp_path / "profiles" / "paper.yaml", yaml.safe_dump(profile, sort_keys=False))
    data["model"].update(attn_dropout=0.1, ffn_dropout=0.1)
    write_text(tmp_path / "params.yaml", yaml.safe_dump(data, sort_keys=False))
    report = _audit(tmp_path, params_from_dict(data))
    text = "\n".join(report["deviations"])
    assert "model.attn_dropout = 0.1 (paper: none: dropout only on sub-layer outputs and embedding sums)" in text
    assert "model.ffn_dropout = 0.1 (paper: none: dropout only on sub-layer outputs and embedding sums)" in text
    items = _by_item(report)
    assert "tensor2tensor transformer_base_v1 attention_dropout=0.0" in items["Attention-weight dropout"]["source"]
    assert "fairseq transformer_wmt_en_de activation_dropout=0.0" in items["FFN hidden dropout"]["source"]
    listed = {d["key"] for d in report["profile_differences"]}
    assert ("model.attn_dropout" in listed) == (profile_dropout != 0.1)  # the profile list is information only


def test_missing_optional_inputs_are_not_measured_items(audit_world: Path, tmp_path: Path) -> None:
    root = _copy(audit_world, tmp_path)
    _, params, _ = profile_params("tiny", root)
    (root / "data" / "metrics" / "evaluate.details.json").unlink()
    (root / "data" / "model" / "averaged.pt").unlink()
    items = _by_item(_audit(root, params))
    for name in ("BLEU, sacreBLEU 13a, test", "BLEU, paper's method (tok+split), valid, newest checkpoint",
                 "Perplexity per BPE token, valid, newest checkpoint", "Averaged vs newest checkpoint, valid BLEU",
                 "Valid set, averaged model", "Sources cut at max_positions"):
        assert items[name]["verdict"] == "not measured", name
    assert items["Parameters"]["note"].startswith("from average.details.json")  # falls back to the average stage's count
    assert items["Tied embeddings"]["verdict"] == "not measured"
    (root / "data" / "metrics" / "average.details.json").unlink()
    shutil.rmtree(root / "data" / "train")
    (root / "data" / "metrics" / "train.details.json").unlink()
    items = _by_item(_audit(root, params))
    for name in ("Parameters", "Steps trained", "Target tokens trained", "Target tokens per step", "World size",
                 "Forward passes per step", "Averaging span", "Training time", "Hardware", "GPU-hours",
                 "Training precision"):
        assert items[name]["verdict"] == "not measured" and items[name]["run"].startswith("not measured"), name


def test_audit_is_deterministic(audit_world: Path, tmp_path: Path) -> None:
    """Same inputs, same bytes. The previous audit.json is an input too (the replay compares with it):
    the second audit says "replayed", and from then on an unchanged workspace reproduces its report."""
    root = _copy(audit_world, tmp_path)
    _, params, _ = profile_params("tiny", root)
    names = ("audit.md", "audit.json")
    _audit(root, params)
    first = [(root / "data" / "reports" / n).read_bytes() for n in names]
    shutil.rmtree(root / "data" / "reports")
    _audit(root, params)
    assert [(root / "data" / "reports" / n).read_bytes() for n in names] == first
    _audit(root, params)
    second = [(root / "data" / "reports" / n).read_bytes() for n in names]
    assert b"replayed: identical to the previous evaluation" in second[1]
    _audit(root, params)
    assert [(root / "data" / "reports" / n).read_bytes() for n in names] == second


@pytest.mark.parametrize(("target", "content", "error", "message"), [
    ("data/metrics/train.details.json", "{not json", PipelineError, "data/metrics/train.details.json: not valid JSON"),
    ("data/metrics/evaluate.details.json", "[1, 2]", DataError,
     "data/metrics/evaluate.details.json: expected a JSON object, got list"),
    ("data/metrics/train.details.json", '{"world_size": "2"}', DataError,
     'data/metrics/train.details.json: world_size: expected an integer, got "2"; rerun the stage that writes it'),
    ("data/shards/manifest.json", "", PipelineError, "data/shards/manifest.json: not valid JSON"),
    ("dvc.lock", "stages: [unclosed", PipelineError,
     r"dvc.lock: line 1, column \d+: not valid YAML: .*; fix the file there, or restore it from git"),
    ("dvc.lock", "a: &x [1]\nb: *x\n", PipelineError,
     r"dvc.lock: line 1, column 4: YAML anchors and aliases are not accepted \(found &x\)"),
    ("data/model/averaged.pt", "garbage", CheckpointError, "data/model/averaged.pt: not a checkpoint written by this pipeline"),
])
def test_malformed_inputs_are_named_and_nothing_is_written(audit_world: Path, tmp_path: Path, target: str, content: str,
                                                                error: type, message: str) -> None:
    root = _copy(audit_world, tmp_path)
    _, params, _ = profile_params("tiny", root)
    _audit(root, params)
    before = [(root / "data" / "reports" / n).read_bytes() for n in ("audit.md", "audit.json")]
    (root / target).write_text(content)
    with pytest.raises(error, match=message):
        _audit(root, params)
    assert [(root / "data" / "reports" / n).read_bytes() for n in ("audit.md", "audit.json")] == before
    assert sorted(p.name for p in (root / "data" / "reports").iterdir()) == ["audit.json", "audit.md"]


def test_git_commit_and_dirty_flag(audit_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's own records (dvc.lock, metrics/, plots/) are not edits; params.yaml is, except in a profile run."""
    root = _copy(audit_world, tmp_path)
    (root / "metrics").mkdir()
    (root / "metrics" / "train.json").write_text("{}\n")
    _, params, _ = profile_params("tiny", root)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@e"}
    for args in (["init", "-q"], ["add", "params.yaml", "dvc.lock", "metrics"], ["commit", "-qm", "x"]):
        subprocess.run(["git", *args], cwd=root, check=True, env=env)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    (root / "dvc.lock").write_text((root / "dvc.lock").read_text() + "\n")  # dvc repro rewrites it: not dirty
    (root / "metrics" / "train.json").write_text('{"step": 1}\n')  # a stage rewrites its metrics: not dirty
    assert _audit(root, params)["lineage"]["git"] == {"commit": commit, "dirty": False, "dirty_paths": []}
    (root / "params.yaml").write_text((root / "params.yaml").read_text() + "\n")
    assert _audit(root, params)["lineage"]["git"] == {"commit": commit, "dirty": True, "dirty_paths": ["params.yaml"]}
    monkeypatch.setenv("NMT_PROFILE_RUN", "tiny")  # the flow wrote params.yaml for this run and restores it after
    assert _audit(root, params)["lineage"]["git"] == {"commit": commit, "dirty": False, "dirty_paths": []}


def test_bleu_verdicts_on_newstest2014(audit_world: Path, tmp_path: Path) -> None:
    root = _copy(audit_world, tmp_path)
    data, _, _ = profile_params("tiny", root)
    data["download"]["dataset"] = "wmt14"
    params = params_from_dict(data)
    path = root / "data" / "metrics" / "evaluate.details.json"
    bleu = json.loads(path.read_text())
    verdicts = {}
    for tok, sacre, n in ((27.0, 26.0, 3003), (26.5, 25.5, 3003), (27.5, 26.5, 3000)):
        bleu["test"].update(bleu_tok_split=tok, bleu=sacre, sentences=n)
        path.write_text(json.dumps(bleu))
        items = _by_item(_audit(root, params))
        verdicts[(tok, n)] = (items["BLEU, paper's method (tok+split), test"], items["BLEU, sacreBLEU 13a, test"])
    assert [v["verdict"] for v in verdicts[(27.0, 3003)]] == ["matches", "matches"]
    assert [v["verdict"] for v in verdicts[(26.5, 3003)]] == ["deviates", "deviates"]
    assert verdicts[(26.5, 3003)][0]["deviation"] == "26.50 (paper: 27.3; matching needs >= 26.8)"
    assert verdicts[(27.5, 3000)][0]["verdict"] == "informational"
    assert "test set of 3000 sentences (newstest2014 full: 3,003)" in verdicts[(27.5, 3000)][0]["note"]


def test_hardware_and_gpu_hours_from_the_recorded_device(audit_world: Path, tmp_path: Path) -> None:
    root = _copy(audit_world, tmp_path)
    _, params, _ = profile_params("tiny", root)
    path = root / "data" / "metrics" / "train.details.json"
    train = json.loads(path.read_text())
    path.write_text(json.dumps({**train, "device": "cpu"}))
    items = _by_item(_audit(root, params))
    assert items["Hardware"]["run"] == "1 x cpu" and items["Hardware"]["verdict"] == "deviates"
    assert items["GPU-hours"]["run"] == "not measured (no GPU: trained on cpu)"
    assert (items["Training precision"]["run"], items["Training precision"]["verdict"]) == ("fp32", "matches")
    path.write_text(json.dumps({**train, "device": "cuda", "device_name": "NVIDIA H100", "world_size": 4,
                                "wall_seconds": 5400.0, "resumed_from_step": None}))
    items = _by_item(_audit(root, params))
    assert items["Hardware"]["deviation"] == "trained on 4 x NVIDIA H100 (paper: 8 x P100)"
    assert items["Training precision"]["deviation"] == "bf16 autocast on the GPU (paper: fp32)"
    assert items["Training time"]["run"] == "1.500 h" and items["GPU-hours"]["run"] == "6.00"
    path.write_text(json.dumps({**train, "device": "cuda", "device_name": "Tesla P100-SXM2-16GB", "world_size": 8,
                                "wall_seconds": 999.0, "train_seconds": 12 * 3600, "resumed_from_step": 500}))
    items = _by_item(_audit(root, params))
    assert items["Hardware"]["verdict"] == "matches"
    assert items["Training time"]["note"].startswith("cumulative step time")  # resumed: not one wall-clock
    assert (items["Training time"]["verdict"], items["GPU-hours"]["verdict"]) == ("matches", "matches")


@pytest.mark.slow
def test_cli_with_params(audit_world: Path, tmp_path: Path) -> None:
    root = _copy(audit_world, tmp_path)
    profile_params("tiny", root)
    (root / "custom.yaml").write_text((root / "params.yaml").read_text())
    (root / "params.yaml").unlink()
    cmd = [sys.executable, "-m", "pipeline.audit", "--params", "custom.yaml"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads((root / "data" / "reports" / "audit.json").read_text())
    assert report["profile"] == "tiny" and (root / "data" / "reports" / "audit.md").is_file()
    details = json.loads((root / "data" / "metrics" / "audit.details.json").read_text())
    assert details["matches"] == report["summary"]["paper"]["matches"] and details["mlflow_run_id"] is None
    assert not (root / "data" / "metrics" / "audit.json").exists()  # not a stage whose numbers DVC compares
    (root / "data" / "metrics" / "encode.details.json").write_text("{")
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 1
    assert "error: stage audit: data/metrics/encode.details.json: not valid JSON" in done.stderr
