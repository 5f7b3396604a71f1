"""The ``nmt`` command: profiles, the whole pipeline and sweeps (through Prefect flows), translate and export."""

from __future__ import annotations

import argparse
import logging
import sys

from pipeline.core import env, stages
from pipeline.core.errors import PipelineError
from pipeline.core.stage import setup_logging

log = logging.getLogger("nmt")


def _cmd_profile(args: argparse.Namespace) -> int:
    from pipeline.project.profiles import listing, write_profile

    if args.name is None:
        print("\n".join(listing()))
    else:
        log.info("wrote %s for profile %s", write_profile(args.name), args.name)
    return 0


def _exec_flow(cmd: list[str]) -> int:
    """Become the flow ``python -m <cmd>`` (``exec``), so Ctrl-C, SIGTERM and SIGKILL reach it, which stops its
    stage (flows/lifeline.py); a parent process would have to forward each signal."""
    import os

    log.info("-m %s", " ".join(cmd))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", *cmd])
    return 0  # pragma: no cover - execv does not return


def _cmd_run(args: argparse.Namespace) -> int:
    """The Prefect flow ``wmt14-pipeline`` (flows/pipeline.py), the one whole-pipeline runner."""
    for name in args.stages:  # refused before anything runs or any MLflow run is opened
        stages.get(name)
    cmd = ["flows.pipeline"] + (["--stages", *args.stages] if args.stages else [])
    cmd += (["--profile", args.profile] if args.profile else []) + (["--force"] if args.force else [])
    return _exec_flow(cmd)


def _cmd_sweep(args: argparse.Namespace) -> int:
    """The Prefect flow ``wmt14-sweep`` (flows/sweep.py), which refuses a bad spec before it starts anything."""
    return _exec_flow(["flows.sweep", args.spec])


def build_parser() -> argparse.ArgumentParser:
    """The ``nmt`` argument parser (one sub-command per action)."""
    parser = argparse.ArgumentParser(prog="nmt", description="WMT14 EN-DE Transformer pipeline")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="write params.yaml for a profile (no name: list the profiles, "
                                       "* marking the one params.yaml holds)")
    p.add_argument("name", nargs="?")
    p.set_defaults(func=_cmd_profile)
    p = sub.add_parser("run", help="the Prefect flow: each stage's `dvc repro --single-item` under one MLflow "
                                   "parent run (python -m flows.pipeline)")
    p.add_argument("stages", nargs="*",
                   help=f"stages to run, in pipeline order (default: all): {', '.join(stages.NAMES)}")
    p.add_argument("--profile", help="run with this profile's params.yaml (demo, multi30k, tiny, paper); the previous "
                                     "params.yaml is restored afterwards (`nmt profile NAME` switches for good)")
    p.add_argument("--force", action="store_true", help="rerun stages even if DVC thinks they are up to date")
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser("sweep", help="the Prefect flow wmt14-sweep: variants of a profile as DVC experiments "
                                     "under one MLflow parent run, compared by valid BLEU (python -m flows.sweep)")
    p.add_argument("spec", help="the sweep's YAML spec: name, profile, grid or variants (docs/orchestration.md)")
    p.set_defaults(func=_cmd_sweep)
    from pipeline.inference import ct2, translate

    translate.add_parser(sub)
    ct2.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``nmt`` console script."""
    setup_logging()
    env.prefer_this_interpreter()  # the flows' dvc and stage commands run in this environment
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
