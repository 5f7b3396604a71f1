"""The toy DVC pipeline the flow tests run: ``toy.py`` stages instead of the ML stages, and process checks.

What is under test with it is the flow (sequencing, status parsing, retries, failures, timeouts,
process-group killing, stopping, the workspace lock and the report), not the stages.
"""

from __future__ import annotations

import shutil
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from tests.helpers.repoutil import git

TOY = textwrap.dedent('''
    import json, os, subprocess, sys, time
    from pathlib import Path

    import yaml

    def metrics_dir():
        return Path(yaml.safe_load(open("params.yaml"))["paths"]["metrics"])

    mode, *args = sys.argv[1:]
    if mode == "write":                       # write OUT [IN]: OUT = IN + "x"
        text = Path(args[1]).read_text() if len(args) > 1 else ""
        Path(args[0]).write_text(text + "x")
        print(f"wrote {args[0]}")
        print(f"stage log {args[0]}", file=sys.stderr)
    elif mode == "flaky":                     # flaky MARKER OUT: fails until MARKER exists
        if not Path(args[0]).exists():
            Path(args[0]).write_text("1")
            print("transient failure", file=sys.stderr)
            sys.exit(3)
        Path(args[1]).write_text("ok")
    elif mode == "fail":                      # fail: 30 stderr lines, exit 7
        for i in range(30):
            print(f"err line {i}", file=sys.stderr)
        sys.exit(7)
    elif mode == "spawn":                     # spawn PIDFILE: a child sleep, both pids recorded
        child = subprocess.Popen(["sleep", "60"])
        tmp = Path(args[0] + ".tmp")
        tmp.write_text(f"{child.pid} {os.getpid()}")
        tmp.rename(args[0])
        time.sleep(60)
    elif mode == "count":                     # count STATE OUT N PIDFILE: resumable work, a line per 0.2 s
        state, n = Path(args[0]), int(args[2])
        child = subprocess.Popen(["sleep", "600"])
        tmp = Path(args[3] + ".tmp")
        tmp.write_text(f"{child.pid} {os.getpid()}")
        tmp.rename(args[3])
        done = len(state.read_text().splitlines()) if state.exists() else 0
        with state.open("a") as out:          # STATE persists across runs (DVC `persist: true`)
            for i in range(done, n):
                out.write(f"{i}\\n")
                out.flush()
                time.sleep(0.2)
        child.kill()
        Path(args[1]).write_text(str(n))
    elif mode == "bleu":                      # bleu OUT: evaluate.details.json shaped like the evaluate stage's
        sig = "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.5.1"
        report = {s: {"bleu": b, "chrf": 50.0, "signatures": {"bleu": sig, "chrf": "chrF2"}}
                  for s, b in (("valid", 25.25), ("test", 27.31))}
        report["chosen"] = {"beam": 4, "alpha": 0.6, "chosen_on": "valid"}
        (metrics_dir() / "evaluate.details.json").parent.mkdir(parents=True, exist_ok=True)
        (metrics_dir() / "evaluate.details.json").write_text(json.dumps(report))
        Path(args[0]).write_text("scored")
    elif mode == "track":                     # track OUT: a child MLflow run like a real stage
        from pipeline.tracking import stage_run
        stage = os.environ["DVC_STAGE"]
        with stage_run(stage) as run:
            run.set_tags({"seen_flow_run_id": os.environ.get("NMT_PREFECT_FLOW_RUN_ID", "")})
        metrics_dir().mkdir(parents=True, exist_ok=True)
        (metrics_dir() / f"{stage}.details.json").write_text(json.dumps({"mlflow_run_id": run.run_id}))
        Path(args[0]).write_text("tracked")
''')

MakeRepo = Callable[[dict[str, dict]], Path]

PIPELINE = {
    "prep": {"cmd": "python toy.py write prep.txt", "deps": ["toy.py"], "outs": ["prep.txt"]},
    "build": {"cmd": "python toy.py write build.txt prep.txt", "deps": ["toy.py", "prep.txt"],
              "outs": ["build.txt"]},
    "score": {"cmd": "python toy.py bleu score.txt", "deps": ["toy.py", "build.txt"], "outs": ["score.txt"]},
}


def make_toy_repo(template: Path, repo: Path, repo_root: Path, stages: dict[str, dict]) -> Path:
    """Copy the empty git + DVC ``template`` to ``repo`` and commit ``toy.py``, params, profiles and ``stages``."""
    shutil.copytree(template, repo, symlinks=True)
    (repo / "toy.py").write_text(TOY)
    shutil.copy(repo_root / "profiles" / "paper.yaml", repo / "params.yaml")  # never the working tree's
    shutil.copytree(repo_root / "profiles", repo / "profiles")
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "toy pipeline")
    return repo


def alive(pid: int) -> bool:
    """A process exists and is not a zombie (an unreaped zombie has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_dead(pids: list[int], limit_s: float = 10.0) -> list[int]:
    """Wait up to ``limit_s`` for every pid to end; return those still alive."""
    deadline = time.monotonic() + limit_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def group_pids(pgid: int) -> list[int]:
    """The processes whose process group is ``pgid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid:
            found.append(int(stat.parent.name))
    return found


def wait_gone(pids: list[int], limit_s: float = 10.0) -> list[int]:
    """Wait up to ``limit_s`` until every pid has left /proc (ended and reaped: DVC's lock check counts an
    unreaped zombie as a holder); return those still there."""
    deadline = time.monotonic() + limit_s
    while (left := [p for p in pids if Path(f"/proc/{p}").exists()]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def wait_for(path: Path, proc, limit_s: float = 90.0) -> None:
    """Wait until ``path`` exists while ``proc`` (a Popen with piped output) still runs."""
    deadline = time.monotonic() + limit_s
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.2)
