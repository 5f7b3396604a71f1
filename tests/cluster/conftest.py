"""A real Slurm on 127.0.0.1 for the tests here: Debian's ``slurm-wlm`` (slurmctld and two slurmd, ``n1`` and
``n2``, in Slurm's multiple-slurmd mode: one host, one port each), no cgroups, started once per session and
stopped at its end. Skipped, with one line saying why, where Slurm is not installed or will not start."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.nodes import free_port
from tests.helpers.prefect_server import prefect_server as server

#: The nodes of the test cluster, one slurmd each.
NODES = ("n1", "n2")
#: How long the daemons get to report both nodes idle.
START_S = 60


def slurm_conf(root: Path) -> str:
    """slurm.conf of a cluster of :data:`NODES` on 127.0.0.1, every state file under ``root``: auth/none (no munge
    key to share on one host), proctrack/linuxproc and task/none (no cgroups), one CPU per node."""
    nodes = "\n".join(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} CPUs=1"
                      for name in NODES)
    return f"""\
ClusterName=nmt-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def idle_nodes(environ: dict[str, str]) -> int:
    """How many nodes ``sinfo`` reports idle (0 while slurmctld is not answering)."""
    done = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=environ, capture_output=True, text=True,
                          timeout=10, check=False)
    return done.stdout.split().count("idle") if done.returncode == 0 else 0


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment (``SLURM_CONF``) of a running two-node Slurm on 127.0.0.1; the daemons end with the
    session."""
    missing = [tool for tool in ("slurmctld", "slurmd", "sbatch", "sinfo", "scontrol") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} not on PATH; apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("the test Slurm runs its daemons as root (SlurmdUser=root); run as root")
    root = tmp_path_factory.mktemp("slurm")
    for folder in ("state", "spool"):
        (root / folder).mkdir()
    (root / "slurm.conf").write_text(slurm_conf(root), encoding="utf-8")
    environ = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    daemons = []
    for name, cmd in [("slurmctld", ["slurmctld", "-D"]), *((node, ["slurmd", "-D", "-N", node]) for node in NODES)]:
        with open(root / f"{name}.err", "w", encoding="utf-8") as err:
            daemons.append(subprocess.Popen(cmd, env=environ, stdout=subprocess.DEVNULL, stderr=err,
                                            start_new_session=True))
    try:
        deadline = time.monotonic() + START_S
        while idle_nodes(environ) < len(NODES):
            if time.monotonic() > deadline or any(d.poll() is not None for d in daemons):
                lines = [line for path in sorted(root.glob("*.err")) for line in path.read_text().splitlines()]
                why = [line for line in lines if "fatal" in line] or [line for line in lines if "error" in line]
                pytest.skip(f"Slurm did not start its {len(NODES)} nodes within {START_S} s: "
                            f"{why[0] if why else 'no error logged'} (logs in {root})")
            time.sleep(0.5)
        yield environ
    finally:
        for daemon in daemons:
            daemon.terminate()
        for daemon in daemons:
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """``prefect server start`` (tests/helpers/prefect_server.py); the environment its clients and workers use. A
    run that waits for a deployment's concurrency slot is offered it again after 1 s (30 s by default), workers poll
    every second."""
    settings = {"PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "1", "PREFECT_WORKER_QUERY_SECONDS": "1",
                "PREFECT_WORKER_PREFETCH_SECONDS": "0"}
    with server(tmp_path_factory.mktemp("prefect-server"), settings) as (environ, _log):
        yield environ
