"""A team's S3 remote, the one ``dvc remote add -d`` the docs show, against an S3-compatible server on 127.0.0.1
(moto's ``ThreadedMotoServer``): a stage pushed with its run cache from one clone is restored in another, which
runs no stage command. Needs the ``s3`` extra (dvc-s3) and moto's server mode; skipped in one line without them."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.helpers.repoutil import git, init_git_dvc

pytestmark = pytest.mark.slow
moto_server = pytest.importorskip("moto.server", reason="moto[server] not installed (pip install 'moto[server]')")
pytest.importorskip("dvc_s3", reason='the s3 extra is not installed (pip install -e ".[s3]")')

STAGE = "stages:\n  shout:\n    cmd: python -c \"open('out.txt','w').write(open('in.txt').read().upper())\"\n" \
        "    deps: [in.txt]\n    outs: [out.txt]\n"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dvc(repo: Path, env: dict[str, str], *args: str) -> str:
    done = subprocess.run(["dvc", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"dvc {' '.join(args)}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout


def _point_at(repo: Path, env: dict[str, str], endpoint: str) -> None:
    _dvc(repo, env, "remote", "add", "-d", "--local", "team", "s3://results/wmt14")
    _dvc(repo, env, "remote", "modify", "--local", "team", "endpointurl", endpoint)


def test_the_run_cache_travels_through_an_s3_remote(tmp_path: Path) -> None:
    import boto3

    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
               "AWS_DEFAULT_REGION": "us-east-1"}
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                     region_name="us-east-1").create_bucket(Bucket="results")
        a = init_git_dvc(tmp_path / "a")
        (a / "in.txt").write_text("hello\n", encoding="utf-8")
        (a / "dvc.yaml").write_text(STAGE, encoding="utf-8")
        git(a, "add", "-A")
        git(a, "commit", "-qm", "one stage")
        _point_at(a, env, endpoint)
        assert "Running stage 'shout'" in _dvc(a, env, "repro")
        _dvc(a, env, "push", "--run-cache")

        b = tmp_path / "b"
        subprocess.run(["git", "clone", "-q", str(a), str(b)], check=True)
        _point_at(b, env, endpoint)
        out = _dvc(b, env, "repro", "--pull")
        assert "Running stage" not in out and "is cached - skipping run" in out, out
        assert (b / "out.txt").read_text(encoding="utf-8") == "HELLO\n"
    finally:
        server.stop()
