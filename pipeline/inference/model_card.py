"""The model card (README.md) of a Hugging Face export, written from the run's own records.

The records are found beside the model: the checkout above ``<paths.model>/averaged.pt`` whose params.yaml (or one
of whose profiles) names that folder as ``paths.model``; then ``<paths.metrics>/*.details.json`` (the stages'
figures) and ``<paths.reports>/audit.json`` (the audit's deviations and the commit). What is missing is said so.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from model.config import TransformerConfig
from pipeline.core import gitstate
from pipeline.core.details import RunDetails
from pipeline.core.errors import PipelineError
from pipeline.core.yamlfile import Plain, PlainMapping, load_yaml

log = logging.getLogger(__name__)

#: The data's terms, as the README's "Data and its terms" states them, per ``download.dataset``.
TERMS = {"wmt14": "WMT14 (statmt.org): research use; cite the WMT14 findings paper (Bojar et al., 2014).",
         "multi30k": "Multi30k: non-commercial research and education use; cite Elliott et al. (2016); the Flickr "
                     "terms apply to the images it derives from."}
NOT_RECORDED = "not recorded"
#: The profile the others are merged over (pipeline/project/profiles.py).
BASE = "paper"


@dataclass(frozen=True)
class Run:
    """Where a model's run keeps its records: the checkout, the profile, its ``paths`` section and its dataset."""

    root: Path
    profile: str | None
    paths: dict[str, str]
    dataset: str | None


def _sections(data: Plain) -> tuple[PlainMapping, PlainMapping]:
    """The ``paths`` and ``download`` mappings of a params file's contents (empty where absent)."""
    data = data if isinstance(data, dict) else {}
    paths, download = data.get("paths"), data.get("download")
    return paths if isinstance(paths, dict) else {}, download if isinstance(download, dict) else {}


def _candidates(root: Path) -> list[Run]:
    """The runs ``root``'s params.yaml and profiles (profiles/<name>.yaml over profiles/paper.yaml) describe."""
    def read(path: Path) -> Plain:
        try:
            return load_yaml(path)
        except (OSError, PipelineError):
            return None

    found = []
    data = read(root / "params.yaml")
    if isinstance(data, dict):
        paths, download = _sections(data)
        found.append(Run(root, data.get("profile"), paths, download.get("dataset")))
    base_paths, base_download = _sections(read(root / "profiles" / f"{BASE}.yaml"))
    for path in sorted((root / "profiles").glob("*.yaml")):
        paths, download = _sections(read(path))
        found.append(Run(root, path.stem, {**base_paths, **paths}, {**base_download, **download}.get("dataset")))
    return found


def find_run(model_path: Path) -> Run | None:
    """The run that wrote ``model_path`` (an ``averaged.pt``), or None when no checkout above names its folder."""
    folder = model_path.resolve().parent
    for root in folder.parents:
        if (root / "params.yaml").is_file() or (root / "profiles").is_dir():
            for run in _candidates(root):
                keys = ("model", "metrics", "reports")
                if all(isinstance(run.paths.get(k), str) for k in keys) and \
                        (root / run.paths["model"]).resolve() == folder:
                    return run
    return None


def _read_json(path: Path) -> PlainMapping | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _bleu_lines(details: RunDetails) -> list[str]:
    ev = details.evaluate
    lines = []
    for split, figures in (("valid", ev.valid), ("test", ev.test)):
        if figures.bleu is None:
            lines.append(f"- {split} BLEU: {NOT_RECORDED} (run `dvc repro evaluate`)")
        else:
            lines.append(f"- {split} BLEU: {figures.bleu:.2f} ({figures.sentences} sentences; sacreBLEU "
                         f"`{figures.signatures.get('bleu', NOT_RECORDED)}`)")
    if ev.chosen.beam is not None:
        lines.append(f"- decoding: beam {ev.chosen.beam}, length penalty α {ev.chosen.alpha} (chosen on "
                     f"{ev.chosen.chosen_on}), this project's search (GNMT's length penalty)")
    if ev.machine.describe():
        lines.append(f"- evaluated on: {ev.machine.describe()}")
    return lines


def _run_lines(run: Run, details: RunDetails, audit: PlainMapping | None) -> list[str]:
    """The card's lines on the run: profile, data, training, averaging, commit (the audit's ``lineage.git``)."""
    train, average = details.train, details.average
    steps = ", ".join(str(s) for s in average.steps) or NOT_RECORDED
    pairs = ", ".join(f"{split} {n:,}" for split, n in details.download.pairs.items())
    git = ((audit or {}).get("lineage") or {}).get("git") or {}
    commit = git.get("commit")
    where = "the audit's record" if commit else "the checkout at export, not a run record"
    commit = commit or gitstate.commit(run.root) or NOT_RECORDED
    device = train.machine.describe() if train.device == "cpu" else train.device_name
    weights = f"{average.parameters:,}" if average.parameters else NOT_RECORDED
    return [f"- profile: `{run.profile or NOT_RECORDED}`",
            f"- data: {run.dataset or NOT_RECORDED}; pairs: {pairs or NOT_RECORDED}",
            f"- training: {train.step if train.step is not None else NOT_RECORDED} steps"
            + (f" on {device}" if device else "")
            + (f"; last valid perplexity {train.valid_ppl:.2f}" if train.valid_ppl is not None else ""),
            f"- averaged checkpoints (steps): {steps}; {weights} parameters",
            f"- commit: `{commit}` ({where}{', with edits' if git.get('dirty') else ''})"]


def render(model_path: Path, config: TransformerConfig) -> str:
    """The model card's markdown for the ``averaged.pt`` at ``model_path``."""
    run = find_run(model_path)
    head = ["---", "library_name: transformers", "pipeline_tag: translation", "language: [en, de]",
            "tags: [translation, marian]", "---", "", "# Transformer (Attention Is All You Need) EN→DE", "",
            f"Exported by `nmt export --format hf` from `{model_path.name}`: MarianMT's classes holding this "
            "project's weights, its model dimension permuted (sines first, then cosines) to MarianMT's sinusoid "
            "layout; the logits equal the project's model's (tests/pipeline/inference/test_hf_export.py).", "",
            "```python", "from transformers import pipeline", "",
            "translate = pipeline(\"translation\", model=\"<this folder>\")",
            "print(translate(\"A man is riding a bicycle.\")[0][\"translation_text\"])", "```", "",
            f"Model: d_model {config.d_model}, {config.n_heads} heads, d_ff {config.d_ff}, {config.n_layers} layers "
            f"each side, {config.vocab_size} shared BPE pieces, up to {config.max_positions} positions. "
            "generation_config.json: beam 4 (the paper's) and transformers' own length penalty, so beam outputs "
            "may differ from `nmt translate`'s; greedy (num_beams=1) outputs are the same.", ""]
    if run is None:
        log.warning("%s: no checkout above it names its folder as paths.model; the model card has no run records",
                    model_path)
        return "\n".join([*head, "## Run", "", f"No run records found beside {model_path}.", ""])
    metrics, reports = run.root / run.paths["metrics"], run.root / run.paths["reports"]
    details = RunDetails.read(metrics)
    audit = _read_json(reports / "audit.json")
    deviations = (audit or {}).get("deviations")
    terms = TERMS.get(run.dataset or "", f"see the publisher of {run.dataset}")
    body = ["## Data and its terms", "", terms, "", "## Run", "", *_run_lines(run, details, audit), "",
            "## BLEU", "", *_bleu_lines(details), "", "## The audit's deviations from the paper", ""]
    if isinstance(deviations, list):
        body += [f"- {d}" for d in deviations] or ["- none"]
    else:
        body.append(f"No audit.json in {run.paths['reports']} (run `dvc repro audit`).")
    return "\n".join([*head, *body, "", f"Records: {run.paths['metrics']}/*.details.json, {run.paths['reports']}/"
                                         "audit.json.", ""])
