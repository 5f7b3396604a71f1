"""Helpers of the fault-injection tests: torchrun jobs as real process trees, and bitwise comparisons."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from pipeline.artifacts import checkpoint
from tests.helpers.paths import REPO


def job_env(nproc: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a CPU torchrun job (one thread per rank, no fault unless ``env`` sets one).

    ``NMT_MAX_TOKENS=96`` splits each rank's share of a step into several forward passes, so the
    points between passes (``mid_accum``) are reached.
    """
    base = {k: v for k, v in os.environ.items() if not k.startswith("NMT_FAULT")}
    return {**base, "NMT_NPROC": str(nproc), "NMT_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "NMT_THREADS": "1",
            "NMT_MAX_RESTARTS": "0", "NMT_MAX_TOKENS": "96", **(env or {})}


def write_params(data: dict, tmp: Path) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    params = tmp / "params.yaml"
    params.write_text(yaml.safe_dump(data), encoding="utf-8")
    return params


def start(data: dict, tmp: Path, nproc: int = 2, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m pipeline.launch`` (torchrun) in its own process group; stdout+stderr to ``tmp/job-N.log``."""
    params = write_params(data, tmp)
    n = len(list(tmp.glob("job-*.log")))
    log = open(tmp / f"job-{n}.log", "w", encoding="utf-8")  # noqa: SIM115 - closed by finish()
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.launch", "--params", str(params)], cwd=REPO,
                            env=job_env(nproc, env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log_path = tmp / f"job-{n}.log"  # type: ignore[attr-defined]
    proc.log_file = log  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    """Wait for a job (killing its process group past ``timeout``); returns its exit code and output."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        raise
    finally:
        proc.log_file.close()  # type: ignore[attr-defined]
    return proc.returncode, proc.log_path.read_text(encoding="utf-8")  # type: ignore[attr-defined]


def run(data: dict, tmp: Path, nproc: int = 2, env: dict[str, str] | None = None,
        timeout: float = 120) -> tuple[int, str]:
    """Run a torchrun job to its end; returns its exit code and output."""
    return finish(start(data, tmp, nproc, env), timeout)


def workers_of(params: Path) -> list[int]:
    """Pids of live processes whose command line names ``params`` (the launcher and its ranks)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            status = (entry / "stat").read_text()
        except OSError:
            continue
        if str(params).encode() in cmdline and status.split(")")[-1].split()[0] != "Z":
            pids.append(int(entry.name))
    return pids


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``timeout`` seconds passed; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints under ``run_dir``."""
    return [s for s, _ in checkpoint.complete_checkpoints(run_dir)]


def tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor (and number) of a nested state dict, by dotted path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in tensors(value, f"{prefix}.{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in tensors(value, f"{prefix}[{i}]").items()}
    return {prefix: torch.tensor(float(obj))} if isinstance(obj, (int, float)) else {}


def assert_bitwise_equal(ref: Path, other: Path, step: int) -> None:
    """Checkpoint ``step`` (weights, Adam state, logged history) and the plots file are identical."""
    from tests.helpers.train import checkpoints  # that module imports the training stage (torch), this one not yet

    a, b = checkpoint.step_dir(checkpoints(ref), step), checkpoint.step_dir(checkpoints(other), step)
    for name in (checkpoint.MODEL, checkpoint.OPTIM):
        ta = tensors(torch.load(a / name, weights_only=True))
        tb = tensors(torch.load(b / name, weights_only=True))
        assert ta.keys() == tb.keys() and len(ta) > 5, name
        different = [k for k in ta if not torch.equal(ta[k], tb[k])]
        assert not different, f"{name}: {different[:5]}"
    sa, sb = (json.loads((d / checkpoint.STATE).read_text()) for d in (a, b))
    for key in ("step", "epoch", "position", "tokens_seen", "history", "files"):
        assert sa[key] == sb[key], key
    assert (ref / "plots" / "train.csv").read_bytes() == (other / "plots" / "train.csv").read_bytes()


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant (by parent pid, read from ``/proc/<pid>/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


_LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def _hex_addr(hex_ip: str) -> str:
    """``/proc/net/tcp{,6}`` address (32-bit words in host byte order) as text."""
    import ipaddress
    import socket
    import struct

    raw = b"".join(struct.pack("=I", int(hex_ip[i:i + 8], 16)) for i in range(0, len(hex_ip), 8))
    return str(ipaddress.ip_address(raw)) if len(raw) == 16 else socket.inet_ntoa(raw)


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int, bool]]:
    """Every TCP socket in LISTEN state held by ``pids``: (pid, address, port, is_loopback)."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: TCP_LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            found.append((inodes[fields[9]], _hex_addr(hex_ip), int(hex_port, 16), hex_ip.upper() in _LOOPBACK_HEX))
    return found
