"""Where a sweep's variants run and what it remembers: one git clone per variant, the state file, DVC's commands.

Ours and not DVC's ``dvc exp run --temp`` / ``--queue``: their executors run each experiment in a folder they
delete afterwards, from git-tracked files and the DVC cache alone (``TempDirExecutor`` in
dvc/repo/experiments/executor/local.py), so uncached outputs (``<stage>.details.json``, checkpoints) could neither
be shared by the variants nor kept for a resume, and a queued run gets no environment of its own to name its MLflow
parent (``run_env`` in dvc/repo/experiments/queue/base.py). So each variant runs in its own clone.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

from flows.lifeline import ProcessResult
from flows.sweep_spec import SpecError, SweepSpec
from pipeline.core.config import flatten
from pipeline.core.errors import PipelineError
from pipeline.core.owned import atomic_path, write_text

SWEEPS_DIR = Path(".dvc") / "tmp" / "sweeps"
REPORTS_DIR = Path("reports") / "sweeps"


class VariantFailed(PipelineError):
    """A command of one variant failed; ``summary`` is one line: the failed stage's error line, else DVC's last."""

    def __init__(self, name: str, result: ProcessResult) -> None:
        tail = "\n".join(result.stderr_tail[-8:]) or "(no stderr)"
        lines = [line.strip() for line in result.stderr_tail] or ["(no stderr)"]
        cause = next((line for line in reversed(lines) if line.startswith("error: stage ")), lines[-1])
        self.summary = (f"variant {name}: {cause} (`{' '.join(result.args)}` failed with exit code "
                        f"{result.returncode} after {result.duration_s:.0f} s)")
        super().__init__(f"{self.summary}; last lines of stderr:\n{tail}")


def sweep_dir(root: Path, name: str) -> Path:
    """``<root>/.dvc/tmp/sweeps/<name>``: the sweep's clones, state file and locks."""
    return root / SWEEPS_DIR / name


def _run(cwd: Path, *cmd: str) -> str:
    """Run ``cmd`` in ``cwd``; its stripped stdout (a PipelineError naming the command and its stderr if it fails)."""
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise PipelineError(f"{cwd}: `{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout.strip()


def head_commit(root: Path) -> str:
    """The commit the checkout is at (a sweep runs committed code only; PipelineError when there is none)."""
    try:
        return _run(root, "git", "rev-parse", "--verify", "HEAD^{commit}")
    except PipelineError:
        raise PipelineError(f"{root}: a sweep runs the committed pipeline, and this checkout has no commit; "
                            "commit it first (git add -A && git commit)") from None


def cache_dir(root: Path) -> str:
    """The checkout's DVC cache folder (``dvc cache dir``), which every clone shares."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return str(Path(repo.cache.local_cache_dir).resolve())


def prepare_clone(root: Path, clone: Path, commit: str, cache: str, template: Path | None = None) -> Path:
    """A clone of ``root`` at ``commit`` with ``cache`` as its DVC cache: a copy of ``template`` if given and new;
    an existing one (an interrupted run's) keeps its untracked files (the rerun resumes), loses tracked changes."""
    clone.parent.mkdir(parents=True, exist_ok=True)
    if not (clone / ".git").is_dir() and template is not None and (template / ".git").is_dir():
        with atomic_path(clone) as tmp:  # a copy interrupted half-way is never taken for a clone
            shutil.copytree(template, tmp, symlinks=True,
                            ignore=lambda folder, names: ["tmp"] if Path(folder) == template / ".dvc" else [])
    if not (clone / ".git").is_dir():
        _run(root, "git", "clone", "-q", "--no-checkout", str(root), str(clone))
        _run(clone, "git", "checkout", "-q", "--detach", commit)
        _run(clone, "dvc", "cache", "dir", "--local", cache)
        return clone
    # `dvc exp run` stages dvc.lock after each stage (``_repro_and_track`` in dvc/repo/experiments/executor/
    # base.py): unstaged first, it stays an untracked file, which `reset --hard` would otherwise delete with
    # the record of the stages the interrupted run had built.
    _run(clone, "git", "reset", "-q")
    _run(clone, "git", "reset", "-q", "--hard")
    _run(clone, "git", "checkout", "-q", "--detach", commit)
    for ref in _run(clone, "git", "for-each-ref", "--format=%(refname)", "refs/exps").splitlines():
        _run(clone, "git", "update-ref", "-d", ref)
    return clone


def write_params(clone: Path, params: dict[str, Any], header: str) -> None:
    """Write ``params`` as the clone's params.yaml (``header``: comment lines saying where it comes from)."""
    write_text(clone / "params.yaml", header + yaml.safe_dump(params, sort_keys=False, allow_unicode=True))


def check_applied(clone: Path, applied: dict[str, Any]) -> None:
    """Raise a PipelineError unless ``dvc exp run --set-param`` left each override in params.yaml as the spec has it."""
    got = flatten(yaml.safe_load((clone / "params.yaml").read_text(encoding="utf-8")) or {})
    for key, value in applied.items():
        if got.get(key) != value:
            raise PipelineError(f"{clone / 'params.yaml'}: `dvc exp run --set-param` left {key}={got.get(key)!r}, "
                                f"not {value!r} as the spec says; quote the value in the spec")


def set_param(key: str, value: Any) -> str:
    """``key=value`` for ``dvc exp run --set-param`` (Hydra's override grammar reads JSON scalars and lists)."""
    return f"{key}={json.dumps(value, separators=(',', ':'))}"


def exp_run_command(name: str, applied: dict[str, Any]) -> list[str]:
    """``dvc exp run --name NAME --set-param k=v ...``."""
    return ["dvc", "exp", "run", "--name", name, *(a for k, v in applied.items() for a in ("--set-param",
                                                                                          set_param(k, v)))]


def exp_push_command(name: str) -> list[str]:
    """Push experiment ``name``'s git ref to ``origin``; the data stays in the shared cache (``--no-cache``)."""
    return ["dvc", "exp", "push", "--force", "--no-cache", "origin", name]


def exp_ref(root: Path, name: str, commit: str) -> str | None:
    """The sha of experiment ``name`` on baseline ``commit`` in ``root`` (DVC's ``refs/exps/<2>/<38>/<name>``)."""
    ref = f"refs/exps/{commit[:2]}/{commit[2:]}/{name}"
    return _run(root, "git", "for-each-ref", "--format=%(objectname)", ref) or None


def _params_entries(entries: Iterable[Any]) -> Iterator[str | None]:
    """The params keys a dvc.yaml stage depends on (None: all of a file)."""
    for entry in entries:
        if isinstance(entry, str):
            yield entry
        elif isinstance(entry, dict):
            for keys in entry.values():
                yield from (keys if isinstance(keys, list) else [None])


def _touches(param: str | None, key: str) -> bool:
    return param is None or param == key or key.startswith(f"{param}.") or param.startswith(f"{key}.")


def shared_stages(dvc_yaml: Path, keys: Iterable[str]) -> list[str]:
    """The leading stages of ``dvc_yaml`` no key of ``keys`` touches, up to train (its checkpoints are no DVC output,
    so a variant cannot share them) or the first uncached ``persist`` output."""
    stages = (yaml.safe_load(dvc_yaml.read_text(encoding="utf-8")) or {}).get("stages") or {}
    keys = list(keys)
    shared = []
    for name, stage in stages.items():
        params = list(_params_entries(stage.get("params") or []))
        persists = any(isinstance(o, dict) and o.get("persist") and o.get("cache") is False
                       for out in stage.get("outs") or [] if isinstance(out, dict) for o in out.values())
        if name == "train" or persists or any(_touches(p, k) for p in params for k in keys):
            break
        shared.append(name)
    return shared


class SweepState:
    """The state file ``<sweep dir>/state.json``: the commit, the MLflow parent and each finished variant."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path, self.data = path, data

    @classmethod
    def load(cls, root: Path, spec: SweepSpec, commit: str) -> SweepState:
        """The sweep's state, or a new one at ``commit``; a SpecError when written for other variants or base."""
        path = sweep_dir(root, spec.name) / "state.json"
        plan = {"profile": spec.profile, "variants": [v.key for v in spec.variants]}
        if not path.is_file():
            return cls(path, {"name": spec.name, "commit": commit, "plan": plan, "mlflow_run_id": None, "variants": {}})
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("plan") != plan:
            raise SpecError(spec.source, f"sweep {spec.name!r} already ran with another profile or other variants "
                                         f"({path}); give this spec another name, or delete "
                                         f"{path.parent} to start it over")
        return cls(path, data)

    def done(self, key: str) -> dict[str, Any] | None:
        """The record of a finished variant, or None."""
        record = self.data["variants"].get(key)
        return record if record and record.get("status") == "done" else None

    def save(self) -> None:
        """Write the state file (atomically: a killed run leaves the previous one)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text(self.path, json.dumps(self.data, indent=2) + "\n")  # keys in spec order
