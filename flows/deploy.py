"""Register the ``wmt14-pipeline`` deployment with a Prefect server (the Python twin of prefect.yaml).

A cron schedule, a *process* work pool served by one worker per GPU node, at most one flow run at a
time (a run holds the GPUs and writes the DVC remote), and pull steps that check out the deployed
commit and ``dvc pull`` what the remote already has::

    export PREFECT_API_URL=http://prefect.internal:4200/api
    python -m flows.deploy --repository https://git.example.com/nmt/wmt14.git --cron "0 2 * * 6"

``prefect deploy --all`` with ``prefect.yaml`` registers the same deployment.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from typing import Any
from uuid import UUID

from pipeline.core.errors import PipelineError

log = logging.getLogger(__name__)

# A module path, not ``flows/pipeline.py:...``: Prefect loads a script path as a module named after the
# file's stem ("pipeline") whose submodules resolve in the script's folder and the cwd, so the flow's
# own ``from pipeline.project.profiles import ...`` would find profiles/ (YAML) instead of the package.
ENTRYPOINT = "flows.pipeline:wmt14_pipeline"
FLOW_NAME = "wmt14-pipeline"  # = flows.pipeline.FLOW_NAME (not imported: keeps this module light)
DEFAULT_POOL = "gpu-pool"
DEFAULT_CRON = "0 2 * * 6"  # Saturdays 02:00: a paper run takes about half a day on 8 GPUs
DEFAULT_PARAMETERS: dict[str, Any] = {"profile": "paper", "timeouts_s": {"download": 6 * 3600, "train": 48 * 3600}}


def pull_steps(repository: str, commit: str | None = None, branch: str | None = None) -> list[dict[str, Any]]:
    """Steps a worker runs before the flow: clone at ``commit``, enter the clone, fetch DVC outputs.

    ``dvc pull --allow-missing`` restores whatever the remote holds (upstream stages then show as
    skipped) and leaves the rest for ``dvc repro`` to build.
    """
    clone: dict[str, Any] = {"id": "clone", "repository": repository}
    if commit:
        clone["commit_sha"] = commit
    if branch:
        clone["branch"] = branch
    return [
        {"prefect.deployments.steps.git_clone": clone},
        {"prefect.deployments.steps.set_working_directory": {"directory": "{{ clone.directory }}"}},
        {"prefect.deployments.steps.run_shell_script": {"script": "dvc pull --allow-missing",
                                                         "stream_output": True}},
    ]


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


def deploy(*, repository: str, commit: str | None = None, branch: str | None = None, name: str = "nightly",
           cron: str = DEFAULT_CRON, timezone: str = "UTC", work_pool: str = DEFAULT_POOL,
           parameters: dict[str, Any] | None = None, paused: bool = False) -> UUID:
    """Create or update the deployment on the Prefect API in ``PREFECT_API_URL``.

    Args:
        repository: git URL the workers clone.
        commit: pin this commit (default: the branch head at run time).
        branch: branch to clone.
        name: deployment name (``wmt14-pipeline/<name>``).
        cron: schedule; ``timezone`` applies to it.
        work_pool: a process pool, created if missing.
        parameters: flow parameters (default: paper profile, download/train timeouts).
        paused: register without activating the schedule.

    Returns:
        The deployment id.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy, ConcurrencyOptions
    from prefect.client.schemas.schedules import CronSchedule

    with get_client(sync_client=True) as client:
        _ensure_process_pool(client, work_pool)
        flow_id = client.create_flow_from_name(FLOW_NAME)
        deployment_id = client.create_deployment(
            flow_id=flow_id, name=name, entrypoint=ENTRYPOINT, work_pool_name=work_pool,
            parameters=parameters if parameters is not None else DEFAULT_PARAMETERS,
            schedules=[DeploymentScheduleCreate(schedule=CronSchedule(cron=cron, timezone=timezone), active=True)],
            # One run at a time: a run owns the GPUs and pushes to the DVC remote; extra runs wait.
            concurrency_limit=1,
            concurrency_options=ConcurrencyOptions(collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
            pull_steps=pull_steps(repository, commit, branch), paused=paused, tags=["gpu", "wmt14"],
            description="WMT14 EN-DE Transformer: dvc repro stage by stage (flows/pipeline.py)",
            enforce_parameter_schema=False)
    log.info("deployment %s/%s (%s) on pool %s, cron %r %s", FLOW_NAME, name, deployment_id, work_pool, cron,
             timezone)
    return deployment_id


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.deploy``: register the deployment (needs ``PREFECT_API_URL``)."""
    parser = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", required=True, help="git URL the GPU workers clone")
    parser.add_argument("--commit", help="commit to pin (default: this checkout's HEAD)")
    parser.add_argument("--branch", help="branch to clone")
    parser.add_argument("--no-pin", action="store_true", help="run the branch head instead of a pinned commit")
    parser.add_argument("--name", default="nightly")
    parser.add_argument("--cron", default=DEFAULT_CRON)
    parser.add_argument("--timezone", default="UTC")
    parser.add_argument("--pool", default=DEFAULT_POOL)
    parser.add_argument("--profile", default="paper")
    parser.add_argument("--paused", action="store_true", help="register with the schedule off")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        commit = None if args.no_pin else (args.commit or head_commit())
        deployment_id = deploy(repository=args.repository, commit=commit, branch=args.branch, name=args.name,
                               cron=args.cron, timezone=args.timezone, work_pool=args.pool,
                               parameters={**DEFAULT_PARAMETERS, "profile": args.profile}, paused=args.paused)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(deployment_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
