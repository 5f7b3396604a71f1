"""What the audit reads (:class:`Inputs`): params, the paper profile (informational), the stages' details,
manifests, the newest checkpoint's state, ``averaged.pt``, ``dvc.lock``, git and the environment."""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TypedDict, cast

from pipeline.artifacts import checkpoint, model_file
from pipeline.auditing.replay import Replay, replay
from pipeline.core import env, gitstate
from pipeline.artifacts.checkpoint import StateFile
from pipeline.artifacts.model_file import ModelSummary
from pipeline.core.config import Params, checkpoint_folder, flatten, section_dict
from pipeline.core.data_details import RawManifest, ShardsManifest
from pipeline.core.details import RunDetails, read_json
from pipeline.core.errors import ConfigError, DataError, PipelineError
from pipeline.core.stages import DvcLock
from pipeline.core.textio import sha256_file
from pipeline.core.yamlfile import PlainMapping, load_yaml

log = logging.getLogger(__name__)

FORMAT = 3  # 3: items have a kind (paper, reference, check), counted apart; ranked deviation topics; headline
PAPER_PROFILE = Path("profiles") / "paper.yaml"


class GitState(TypedDict):
    """The workspace's commit (None: not a git checkout) and the paths edited since."""

    commit: str | None
    dirty: bool | None
    dirty_paths: list[str]


@dataclass
class Inputs:
    """Everything the audit reads; ``None`` marks an input that does not exist (yet)."""

    params: Params
    params_sha256: str
    paper_profile: PlainMapping | None
    details: RunDetails
    raw_manifest: RawManifest | None
    shards_manifest: ShardsManifest | None
    shards_manifest_sha256: str | None
    state: StateFile | None  # the newest checkpoint's state.json, but its history
    state_path: str | None
    model: ModelSummary | None
    lock: DvcLock | None
    git: GitState
    environment: dict[str, str | int | None] = field(default_factory=dict)
    replay: Replay = field(default_factory=Replay)

    @property
    def flat(self) -> PlainMapping:
        """The params as dotted keys (``model.d_model``)."""
        return flatten(section_dict(self.params))


def read_optional(path: Path) -> PlainMapping | None:
    """A JSON object (``*.json``) or YAML mapping (else), or None when the file does not exist.

    Raises:
        PipelineError: the file exists but is malformed or not a mapping (names the file).
    """
    if not path.is_file():
        return None
    try:
        data = read_json(path) if path.suffix == ".json" else load_yaml(path)
    except ConfigError as exc:
        raise PipelineError(f"{exc}, or restore it from git or rerun `dvc repro`") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a {'JSON object' if path.suffix == '.json' else 'YAML mapping'}, got "
                        f"{type(data).__name__}; restore it or rerun the stage that writes it")
    return data


def git_state(root: Path) -> GitState:
    """Commit and dirty paths of ``root`` by :mod:`pipeline.core.gitstate`'s rule."""
    commit, temporary_params = gitstate.commit(root), env.settings().profile_run is not None
    paths = [] if commit is None else gitstate.dirty_paths(root, temporary_params=temporary_params)
    return {"commit": commit, "dirty": None if commit is None else bool(paths), "dirty_paths": paths}


def environment(details: RunDetails) -> dict[str, str | int | None]:
    """Versions of the audit's environment and the devices the stages recorded."""
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    train = details.train
    return {"python": platform.python_version(), "torch": version("torch"), "sacrebleu": version("sacrebleu"),
            "sentencepiece": version("sentencepiece"), "dvc": version("dvc"), "mlflow": version("mlflow"),
            "train_device": train.device, "train_device_name": train.device_name,
            "train_world_size": train.world_size, "train_machine": train.machine.describe(),
            "evaluate_device": details.evaluate.device, "evaluate_machine": details.evaluate.machine.describe()}


def previous_replay(path: Path | None) -> Replay | None:
    """The ``replay`` section of the previous ``audit.json`` (None if absent, unreadable or of another format)."""
    try:
        section = (read_optional(path) or {}).get("replay") if path is not None else None
    except PipelineError as exc:  # the audit's own output, replaced by this run: not worth failing for
        log.warning("ignoring the previous audit: %s", exc)
        return None
    return cast(Replay, section) if isinstance(section, dict) else None  # as an earlier audit wrote it


def load_inputs(params: Params, *, params_file: Path, lock_file: Path, root: Path,
                previous_audit: Path | None = None) -> Inputs:
    """Read every input (missing ones None, malformed ones raise); ``previous_audit`` is the audit.json replaced."""
    paths = params.paths
    details = RunDetails.read(root / paths.metrics)
    shards_manifest_path = root / paths.shards / "manifest.json"
    folder = Path(details.train.folder or checkpoint_folder(params))  # where training ran, whatever params say now
    newest = checkpoint.latest(root / folder)
    state_path = newest / checkpoint.STATE if newest is not None else None
    state = cast(StateFile, read_optional(state_path)) if state_path is not None else None
    profile_file = root / PAPER_PROFILE
    if not profile_file.is_file():  # a workspace without profiles/: use the one beside this code
        profile_file = Path(__file__).resolve().parents[2] / PAPER_PROFILE
    lock = cast(DvcLock | None, read_optional(lock_file))  # the mappings as their writers wrote them
    return Inputs(
        params=params, params_sha256=sha256_file(params_file), paper_profile=read_optional(profile_file),
        details=details, raw_manifest=cast(RawManifest | None, read_optional(root / paths.raw / "manifest.json")),
        shards_manifest=cast(ShardsManifest | None, read_optional(shards_manifest_path)),
        shards_manifest_sha256=sha256_file(shards_manifest_path) if shards_manifest_path.is_file() else None,
        state=cast(StateFile, {k: v for k, v in state.items() if k != "history"}) if state else None,
        state_path=str(folder / newest.name / checkpoint.STATE) if newest is not None else None,
        model=model_file.describe(model_file.path_in(root / paths.model)), lock=lock,
        git=git_state(root), environment=environment(details),
        replay=replay(params=params, bleu=details.evaluate if "evaluate" in details.written else None,
                      lock=lock, root=root, previous=previous_replay(previous_audit)))
