"""The GPU benchmarks and checks a lent CUDA machine runs, one command each (dry-run on a CPU by the tests).

    python benchmarks/gpu.py prepare --data data/gpu [--profiles tiny demo multi30k]   # here, on CPU: data stages
    python benchmarks/gpu.py news --data data/gpu            # here: the news chain's data from the shared folder
    python benchmarks/gpu.py check|multi30k --data data/gpu --out OUT   # on the GPU machine (carry data/gpu)
    python benchmarks/gpu.py speed --data data/gpu --out OUT    # on the GPU machine: the stage's step

``check``, ``multi30k`` and ``speed`` rewrite ``OUT/gpu_<command>.json`` and ``OUT/logs.tar.gz`` after every step, so
what finished comes back even if a later step hangs; a step with less left of ``--budget-s`` than it needs is skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO, setup_logging, write_params  # noqa: E402
from benchmarks.gpu_steps import check, multi30k, speed  # noqa: E402
from benchmarks.gpu_steps.runner import Runner, params_for, step_env  # noqa: E402


def run(args: argparse.Namespace) -> int:
    """``check`` or ``multi30k``: ``env``, then the steps, within the budget."""
    budget = args.budget_s if args.budget_s is not None else (3600 if args.dry_run else 540)
    r = Runner(args.out.resolve(), args.work.resolve(), "cpu" if args.dry_run else "cuda",
               f"gpu_{args.command}.json", budget)
    r.results["commit"] = args.commit
    r.save("env", step_env())
    steps = (check.steps(r, args.data, args.profiles, args.modes, args.dry_run) if args.command == "check" else
             speed.steps(r, args.data, args.dry_run) if args.command == "speed" else
             multi30k.steps(r, args.data, args.chains, args.dry_run))
    r.run_steps(steps, args.steps, args.dry_run)
    return 0


def prepare(args: argparse.Namespace) -> int:
    """The data stages of ``--profiles``, here (the device machine has no data)."""
    data = REPO / args.data
    r = Runner(data / "prepare", data / "prepare", "cpu")
    return 0 if all(r.data_stages(profile, write_params(params_for(profile, args.data, None), data / profile))
                    for profile in args.profiles) else 1  # stops at the first failure


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run one command."""
    setup_logging()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    data = argparse.ArgumentParser(add_help=False)
    data.add_argument("--data", type=Path, required=True, help="a folder under data/ (relative to the repository)")
    sub.add_parser("prepare", parents=[data], help="the data stages of some profiles, here").add_argument(
        "--profiles", nargs="+", default=["tiny", "demo"])
    a = sub.add_parser("news", parents=[data], help="the news chain's data from the shared data folder, here")
    a.add_argument("--mirror", type=Path, default=REPO.parent / "shared" / "data", help="the shared data folder")
    a.add_argument("--dry-run", action="store_true", help="a 200-piece BPE, for the tests' small mirror")
    for name, steps in (("check", ["tiny", "demo", "pytest", "precision", "determinism"]),
                        ("multi30k", ["sweep", "newstest"]), ("speed", ["stage", "stage-eager", "bench"])):
        a = sub.add_parser(name, parents=[data], help=f"the {name} steps on the GPU")
        a.add_argument("--out", type=Path, required=True)
        a.add_argument("--work", type=Path, default=Path(f"/tmp/gpu_{name}"), help="runs and logs (%(default)s)")
        a.add_argument("--dry-run", action="store_true", help="CPU, a few steps: checks this script")
        extra = ["throughput"] if name != "speed" else []
        a.add_argument("--steps", nargs="*", choices=[*steps, *extra], help="a subset of the steps, in order")
        a.add_argument("--budget-s", type=float, help="the whole run's seconds (default: 540; a dry run 3600)")
        a.add_argument("--commit", default="", help="recorded in the JSON")
    a = sub.choices["check"]
    a.add_argument("--profiles", nargs=2, default=["tiny", "demo"], metavar=("ONE_PROCESS", "TORCHRUN"))
    a.add_argument("--modes", nargs="+", default=["default", "deterministic"], choices=["default", "deterministic"],
                   help="the determinism step's modes (default: both)")
    a = sub.choices["multi30k"]
    a.add_argument("--chains", nargs="+", choices=multi30k.CHAINS, default=list(multi30k.CHAINS),
                   help="the sweep's runs")
    sub.add_parser("fp32-train", help="the train stage with autocast off (the precision step's reference)"
                   ).add_argument("--params", type=Path, required=True)
    args = p.parse_args(argv)
    if args.command == "news":
        return multi30k.news_data(args.data, args.mirror, args.dry_run)
    if args.command == "fp32-train":
        return check.fp32_train(args.params)
    return (prepare if args.command == "prepare" else run)(args)


if __name__ == "__main__":
    sys.exit(main())
