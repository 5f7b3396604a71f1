"""Register a deployment of ``prefect.yaml`` with a Prefect server from Python (``prefect deploy`` without the CLI).

``prefect.yaml`` is the one definition of the deployments (schedule, work pool, concurrency, parameters,
job environment, pull steps); this module reads it and registers one of them through the API, filling
in what ``prefect deploy`` would compute at deploy time (the repository URL and commit the workers
clone) and any override given on the command line::

    export PREFECT_API_URL=http://prefect.internal:4200/api
    python -m flows.deploy --repository https://git.example.com/nmt/wmt14.git [--cron "0 2 * * 6"]
"""

from __future__ import annotations

import argparse
import copy
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any
from uuid import UUID

from pipeline.core.errors import PipelineError
from pipeline.core.yamlfile import load_yaml

log = logging.getLogger(__name__)

PREFECT_YAML = Path(__file__).resolve().parents[1] / "prefect.yaml"
FLOW_NAME = "wmt14-pipeline"  # = flows.pipeline.FLOW_NAME (not imported: keeps this module light)
DEFAULT_SPEC = "nightly"
DEFAULT_POOL = "gpu-pool"  # = prefect.yaml's work pool (checked by a test)


def deployment_spec(name: str = DEFAULT_SPEC, path: Path = PREFECT_YAML) -> tuple[dict[str, Any], list[Any]]:
    """The deployment ``name`` of ``prefect.yaml`` and the file's pull steps.

    Raises:
        PipelineError: no such file or deployment (the known ones are named), or the file is not valid YAML
            or holds an anchor or alias (:func:`pipeline.core.yamlfile.load_yaml`; the line is named).
    """
    try:
        data = load_yaml(path) or {}
    except OSError as exc:
        raise PipelineError(f"{path}: cannot be read ({exc.strerror or exc}); restore it from git") from None
    specs = {d.get("name"): d for d in data.get("deployments") or []}
    if name not in specs:
        raise PipelineError(f"{path}: no deployment {name!r}; known: {', '.join(map(str, specs))}")
    return copy.deepcopy(specs[name]), copy.deepcopy(data.get("pull") or [])


def pull_steps(template: list[Any], repository: str, commit: str | None = None,
               branch: str | None = None) -> list[dict[str, Any]]:
    """``prefect.yaml``'s pull steps with the clone's repository and commit filled in.

    The file's ``{{ origin.stdout }}`` / ``{{ commit.stdout }}`` come from its build steps, which only
    ``prefect deploy`` runs; here they are ``repository`` and ``commit`` (no commit: the branch head).
    """
    steps = copy.deepcopy(template)
    for step in steps:
        for key, args in step.items():
            if key.endswith(".git_clone"):
                args["repository"] = repository
                args.pop("commit_sha", None)
                if commit:
                    args["commit_sha"] = commit
                if branch:
                    args["branch"] = branch
    return steps


def head_commit(repo: str = ".") -> str:
    """``git rev-parse HEAD`` of ``repo`` (the commit a deployment pins).

    Raises:
        PipelineError: not a git checkout.
    """
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        raise PipelineError(f"{repo}: cannot read the git commit ({exc}); pass --commit") from None


def _ensure_process_pool(client: Any, name: str) -> None:
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    try:
        client.read_work_pool(name)
    except ObjectNotFound:
        client.create_work_pool(WorkPoolCreate(name=name, type="process",
                                               base_job_template=ProcessWorker.get_default_base_job_template(),
                                               description="GPU nodes: one `prefect worker start --limit 1` each"))


def deploy(*, repository: str, commit: str | None = None, branch: str | None = None, spec: str = DEFAULT_SPEC,
           name: str | None = None, cron: str | None = None, work_pool: str | None = None,
           parameters: dict[str, Any] | None = None, env: dict[str, str] | None = None,
           paused: bool = False) -> UUID:
    """Create or update deployment ``spec`` of ``prefect.yaml`` on the Prefect API in ``PREFECT_API_URL``.

    Args:
        repository: git URL the workers clone. commit: pin this commit (default: the branch head at run
            time). branch: branch to clone.
        spec: which deployment of ``prefect.yaml``; name: register it under this name (default: ``spec``).
        cron, work_pool: override the file's schedule and pool (the pool is created if missing).
        parameters: flow parameters merged over the file's. env: job environment merged over the file's.
        paused: register without activating the schedule.

    Returns:
        The deployment id.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy, ConcurrencyOptions
    from prefect.client.schemas.schedules import CronSchedule

    dep, pull = deployment_spec(spec)
    pool = dict(dep.get("work_pool") or {})
    job_variables = copy.deepcopy(pool.get("job_variables") or {})
    job_variables["env"] = {**job_variables.get("env", {}), **(env or {})}
    schedules = [DeploymentScheduleCreate(schedule=CronSchedule(cron=cron or s["cron"], timezone=s.get("timezone")),
                                          active=s.get("active", True)) for s in dep.get("schedules") or []]
    limit = dep.get("concurrency_limit") or {}
    with get_client(sync_client=True) as client:
        _ensure_process_pool(client, work_pool or pool.get("name", DEFAULT_POOL))
        deployment_id = client.create_deployment(
            flow_id=client.create_flow_from_name(FLOW_NAME), name=name or spec, entrypoint=dep["entrypoint"],
            work_pool_name=work_pool or pool.get("name", DEFAULT_POOL), work_queue_name=pool.get("work_queue_name"),
            parameters={**(dep.get("parameters") or {}), **(parameters or {})}, job_variables=job_variables,
            schedules=schedules, concurrency_limit=limit.get("limit"),
            concurrency_options=ConcurrencyOptions(collision_strategy=ConcurrencyLimitStrategy(
                limit.get("collision_strategy", "ENQUEUE"))) if limit else None,
            pull_steps=pull_steps(pull, repository, commit, branch), paused=paused, tags=dep.get("tags") or [],
            description=dep.get("description"), enforce_parameter_schema=False)
    log.info("deployment %s/%s (%s) from %s:%s on pool %s", FLOW_NAME, name or spec, deployment_id, PREFECT_YAML.name,
             spec, work_pool or pool.get("name"))
    return deployment_id


def _pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise PipelineError(f"--env {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.deploy``: register a deployment of prefect.yaml (needs ``PREFECT_API_URL``)."""
    parser = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", required=True, help="git URL the GPU workers clone")
    parser.add_argument("--commit", help="commit to pin (default: this checkout's HEAD)")
    parser.add_argument("--branch", help="branch to clone")
    parser.add_argument("--no-pin", action="store_true", help="run the branch head instead of a pinned commit")
    parser.add_argument("--spec", default=DEFAULT_SPEC, help="deployment of prefect.yaml (default: nightly)")
    parser.add_argument("--name", help="register under this name (default: the spec's)")
    parser.add_argument("--cron", help="override prefect.yaml's schedule")
    parser.add_argument("--pool", help="override prefect.yaml's work pool")
    parser.add_argument("--profile", help="override the profile parameter")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="override or add a job environment variable (repeatable)")
    parser.add_argument("--paused", action="store_true", help="register with the schedule off")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        commit = None if args.no_pin else (args.commit or head_commit())
        deployment_id = deploy(repository=args.repository, commit=commit, branch=args.branch, spec=args.spec,
                               name=args.name, cron=args.cron, work_pool=args.pool,
                               parameters={"profile": args.profile} if args.profile else None,
                               env=_pairs(args.env), paused=args.paused)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(deployment_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
