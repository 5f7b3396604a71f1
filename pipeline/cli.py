"""The ``nmt`` command: profiles, the whole pipeline and sweeps (through Prefect flows), translate and export."""

from __future__ import annotations

import argparse
import logging
import sys

from pipeline.core import env, stages
from pipeline.core.errors import PipelineError
from pipeline.project.options import OneLineParser
from pipeline.core.stage import setup_logging
from pipeline.project import run_options

log = logging.getLogger("nmt")

#: The distribution pyproject.toml names, whose installed version ``nmt --version`` prints.
DISTRIBUTION = "wmt14-transformer"


def version() -> str:
    """The installed version of :data:`DISTRIBUTION` (importlib.metadata), or a line saying it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return f"unknown ({DISTRIBUTION} is not installed: `pip install -e .` in the checkout installs it)"


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
    return _exec_flow(flow_command(args))


def flow_command(args: argparse.Namespace) -> list[str]:
    """``nmt run``'s arguments as the flow's ``python -m`` command (the options are run_options.py's, shared)."""
    return ["flows.pipeline", *(["--stages", *args.stages] if args.stages else []), *run_options.flow_argv(args)]


def _cmd_sweep(args: argparse.Namespace) -> int:
    """The Prefect flow ``wmt14-sweep`` (flows/sweep.py), which refuses a bad spec before it starts anything."""
    return _exec_flow(["flows.sweep", args.spec])


def build_parser() -> argparse.ArgumentParser:
    """The ``nmt`` argument parser (one sub-command per action)."""
    parser = OneLineParser(prog="nmt", description="WMT14 EN-DE Transformer pipeline")
    parser.add_argument("--version", action="version", version=f"nmt {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="write params.yaml for a profile (no name: list the profiles, "
                                       "* marking the one params.yaml holds)")
    p.add_argument("name", nargs="?")
    p.set_defaults(func=_cmd_profile)
    p = sub.add_parser("run", help="the Prefect flow: each stage's dvc repro --single-item under one MLflow "
                                   "parent run (python -m flows.pipeline)", description=run_options.DESCRIPTION)
    p.add_argument("stages", nargs="*",
                   help=f"stages to run, in pipeline order (default: all): {', '.join(stages.NAMES)}")
    run_options.add_options(p)
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
    except KeyboardInterrupt:  # Ctrl-C; output files are written whole (pipeline/core/textio.py, atomic_path)
        print(f"error: nmt {args.command}: interrupted by Ctrl-C; no output file was left half-written",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
