"""The ``nmt`` command: profiles, the whole pipeline and sweeps (through Prefect flows), translate and export, the
MLflow UI and model server."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pipeline import tracking
from pipeline.core import env, stages
from pipeline.core.console import arg_type, setup_logging
from pipeline.core.errors import PipelineError
from pipeline.project import command_line
from pipeline.project.profiles import known_profiles

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
    return _exec([sys.executable, "-m", *cmd], shown=f"-m {' '.join(cmd)}")


def _cmd_run(args: argparse.Namespace) -> int:
    """The Prefect flow ``wmt14-pipeline`` (flows/pipeline.py), the one whole-pipeline runner."""
    for name in args.stages:  # refused before anything runs or any MLflow run is opened
        stages.get(name)
    return _exec_flow(flow_command(args))


def flow_command(args: argparse.Namespace) -> list[str]:
    """``nmt run``'s arguments as the flow's ``python -m`` command (the options are command_line.py's, shared)."""
    return ["flows.pipeline", *(["--stages", *args.stages] if args.stages else []), *command_line.flow_argv(args)]


def _cmd_sweep(args: argparse.Namespace) -> int:
    """The Prefect flow ``wmt14-sweep`` (flows/sweep.py), which refuses a bad spec before it starts anything."""
    return _exec_flow(["flows.sweep", args.spec])


_port = arg_type(lambda text: int(text) if text.isdigit() else 0, lambda port: 1 <= port <= 65535,
                 "a port from 1 to 65535", width=20)


def _mlflow_parsers(sub: argparse._SubParsersAction) -> None:
    """``nmt ui`` and ``nmt serve``: MLflow's UI and model server on this checkout's store, by default on
    127.0.0.1. Run as MLflow's own commands they need the store named (else MLflow creates a stray ./mlflow.db and
    answers ``Registered Model ... not found``) and this environment's bin/ on PATH (the server starts uvicorn);
    these verbs set both, check the model first, then become MLflow (exec), so Ctrl-C stops the server itself;
    ``nmt serve`` runs MLflow's scoring server behind a guard (:mod:`pipeline.tracking.scoring_app`)."""
    p = sub.add_parser("ui", help="the MLflow UI on this checkout's store (http://127.0.0.1:5000)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=5000, help="port (default 5000)")
    p.set_defaults(func=_ui)
    p = sub.add_parser("serve", help="serve a registered model over HTTP (POST /invocations; docs/evaluation.md)")
    p.add_argument("--profile", help=f"whose registered model: {known_profiles()} (default: the profile params.yaml "
                                     "holds)")
    p.add_argument("--alias", default="candidate", help="the version to serve, by alias (default candidate)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=5001, help="port (default 5001)")
    p.set_defaults(func=_serve)


def _exec(argv: list[str], shown: str | None = None) -> int:
    """Become ``argv`` (a bare name is found on PATH, which starts with this environment's bin/: nmt's main)."""
    log.info("%s", shown or " ".join(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, os.environ)
    return 0  # pragma: no cover - exec does not return


def _ui(args: argparse.Namespace) -> int:
    return _exec(["mlflow", "ui", "--backend-store-uri", tracking.tracking_uri("."), "--host", args.host,
                  "--port", str(args.port)])


def _serve(args: argparse.Namespace) -> int:
    """Become the guarded scoring server (:func:`pipeline.tracking.scoring_app.serve_command`)."""
    from pipeline.project.profiles import active_profile
    from pipeline.tracking import model_registry, scoring_app

    profile = args.profile or active_profile(".")
    if profile is None:
        raise PipelineError("nmt serve: params.yaml names no profile here; pass --profile NAME (the profile whose "
                            "registered model to serve) or run it in the checkout's root")
    name, uri = env.model_name(profile), tracking.tracking_uri(".")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    if model_registry.alias_holder(name, args.alias) is None:
        raise PipelineError(f"nmt serve: no version of registered model {name!r} holds alias {args.alias!r} in "
                            f"{uri}; the register stage registers profile {profile}'s model (make demo: demo)")
    argv, command_env = scoring_app.serve_command(model_uri := f"models:/{name}@{args.alias}", args.host, args.port)
    os.environ.update(command_env)
    return _exec(argv, f"serving {model_uri} on http://{args.host}:{args.port} (mlflow's scoring server, guarded)")


def build_parser() -> argparse.ArgumentParser:
    """The ``nmt`` argument parser (one sub-command per action)."""
    parser = command_line.OneLineParser(prog="nmt", description="WMT14 EN-DE Transformer pipeline")
    parser.add_argument("--version", action="version", version=f"nmt {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="write params.yaml for a profile (no name: list the profiles, "
                                       "* marking the one params.yaml holds)")
    p.add_argument("name", nargs="?")
    p.set_defaults(func=_cmd_profile)
    p = sub.add_parser("run", help="the Prefect flow: each stage's dvc repro --single-item under one MLflow "
                                   "parent run (python -m flows.pipeline)", description=command_line.DESCRIPTION)
    p.add_argument("stages", nargs="*",
                   help=f"stages to run, in pipeline order (default: all): {', '.join(stages.NAMES)}")
    command_line.add_options(p)
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser("sweep", help="the Prefect flow wmt14-sweep: variants of a profile as DVC experiments "
                                     "under one MLflow parent run, compared by valid BLEU (python -m flows.sweep)")
    p.add_argument("spec", help="the sweep's YAML spec: name, profile, grid or variants (docs/orchestration.md)")
    p.set_defaults(func=_cmd_sweep)
    from pipeline.inference import export, translate

    translate.add_parser(sub)
    export.add_parser(sub)
    _mlflow_parsers(sub)
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
    except KeyboardInterrupt:  # Ctrl-C; output files are written whole (pipeline/core/owned.py)
        print(f"error: nmt {args.command}: interrupted by Ctrl-C; no output file was left half-written",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
