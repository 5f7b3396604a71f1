"""Security defaults: servers bind 127.0.0.1, no credentials in params or git, none in the logs.

The only place a server listens on every interface is the cluster guide (docs/cluster.md), where a
shared Prefect or MLflow server must be reachable by the GPU nodes. Credentials come from the
environment or DVC's local config; a mirror URL's ``user:password@`` is sent as HTTP basic auth and
never printed, and stage logs and errors mask URL userinfo and the values of secret-looking
environment variables.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from pipeline.core.console import redact
from pipeline.core.errors import EXIT_PERMANENT
from tests.helpers.data_faults import multi30k_mirror, write_params, write_raw
from tests.helpers.paths import REPO

ALL_INTERFACES = re.compile(r"0\.0\.0\.0|\bINADDR_ANY\b|--host[ =]+::|bind\(\(\s*['\"]{2}")
SERVER_START = re.compile(r"\b(mlflow (ui|server|models serve)|prefect server start)\b")
CREDENTIAL_KEY = re.compile(r"(^|_)(password|passwd|secret|token|credentials?|api_?key|access_?key(_id)?|"
                            r"private_?key|auth)($|_)", re.IGNORECASE)
USERINFO = re.compile(r"\b[a-z][a-z0-9+.-]*://[^/\s@'\":]+:(?P<password>[^/\s@'\"]*)@", re.IGNORECASE)
PLACEHOLDER = re.compile(r"\*+|pass(word)?|[$<{].*")  # documentation shows where a password would go, not one
SECRET = "s3cr3t-pw"


def tracked_files() -> list[Path]:
    """The repository's tracked text files (this file excluded: it names the patterns it looks for)."""
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    skip = {str(Path(__file__).resolve().relative_to(REPO)), "constraints.txt"}
    return [REPO / n for n in names if n not in skip and (REPO / n).is_file()
            and (REPO / n).suffix in {".py", ".md", ".yaml", ".yml", ".toml", ".cfg", ".sh", ""}]


def test_no_server_listens_on_all_interfaces_except_in_the_cluster_guide() -> None:
    hits = [f"{path.relative_to(REPO)}:{i}: {line.strip()}" for path in tracked_files()
            for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1)
            if ALL_INTERFACES.search(line)]
    allowed = [h for h in hits if h.startswith("docs/cluster.md:") and "--host 0.0.0.0" in h]
    assert hits == allowed, "\n".join(sorted(set(hits) - set(allowed)))
    assert len(allowed) == 2  # the shared Prefect server and the shared MLflow server
    for path in tracked_files():  # every other server start binds loopback, explicitly or by default
        if path.name == "cluster.md":
            continue
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if SERVER_START.search(line) and re.search(r"(--host|-h)[ =]", line):
                assert re.search(r"(--host|-h)[ =]+(127\.0\.0\.1|localhost)\b", line), line


def test_the_tools_default_to_loopback() -> None:
    """What a command without ``--host`` binds: pins upgrading MLflow or Prefect must not change."""
    import inspect

    import click
    import mlflow.cli
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings.models.server.api import ServerAPISettings

    ctx = click.Context(mlflow.cli.cli)
    models = mlflow.cli.cli.get_command(ctx, "models")
    commands = {"mlflow ui": mlflow.cli.cli.get_command(ctx, "ui"),
                "mlflow server": mlflow.cli.cli.get_command(ctx, "server"),
                "mlflow models serve": models.get_command(click.Context(models), "serve")}
    for name, command in commands.items():
        (host,) = [p for p in command.params if p.name == "host"]
        assert host.default == "127.0.0.1", name
    assert ServerAPISettings.model_fields["host"].default == "127.0.0.1"  # prefect server start
    source = inspect.getsource(SubprocessASGIServer)  # the flow's temporary server
    assert re.search(r'"--host",\s*"127\.0\.0\.1"', source) and "0.0.0.0" not in source
    for path in tracked_files():  # and nothing of ours moves them through the environment
        text = path.read_text(encoding="utf-8", errors="replace")
        assert not re.search(r"(MLFLOW_HOST|PREFECT_SERVER_API_HOST)\s*[=:]", text), path


def _walk(node: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, f"{prefix}{key}.")
            yield f"{prefix}{key}", value
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{prefix}{i}.")


def test_params_profiles_and_committed_configs_hold_no_credentials() -> None:
    # The committed params.yaml is profiles/paper.yaml (tests/pipeline/core/test_config.py); the working tree's
    # may hold another profile, so it is not read here.
    files = [*sorted((REPO / "profiles").glob("*.yaml")), REPO / "dvc.yaml", REPO / "prefect.yaml"]
    for path in files:
        for key, value in _walk(yaml.safe_load(path.read_text(encoding="utf-8"))):
            leaf = key.rsplit(".", 1)[-1]
            assert not CREDENTIAL_KEY.search(leaf), f"{path.name}: {key}"
            if isinstance(value, str):
                assert not USERINFO.search(value) and not re.search(r"AKIA[0-9A-Z]{16}", value), f"{path.name}: {key}"
    dvc_config = (REPO / ".dvc/config").read_text(encoding="utf-8")
    assert not re.search(r"^\s*(password|secret_access_key|access_key_id|session_token|token|key)\s*=", dvc_config,
                         re.MULTILINE | re.IGNORECASE)
    assert "/config.local" in (REPO / ".dvc/.gitignore").read_text(encoding="utf-8").split()
    for line in (REPO / "docs/cluster.md").read_text(encoding="utf-8").splitlines():  # secrets go to config.local
        if re.match(r"\s*dvc remote modify\b", line) and re.search(r"\b(profile|access_key|secret|password|token|"
                                                                     r"credentialpath)\b", line):
            assert "--local" in line, line
    for path in tracked_files():  # no URL with a real password anywhere
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            for match in USERINFO.finditer(line):
                assert PLACEHOLDER.fullmatch(match["password"]), f"{path.relative_to(REPO)}: {line.strip()}"


def test_redact_masks_userinfo_and_secret_environment_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "hunter22")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI")
    monkeypatch.setenv("NMT_PROFILE_NAME", "tiny-secretless")  # not a secret's name: left alone
    text = ("GET https://alice:hunter22@mirror.example/x failed; s3://AKIAKEY:wJalrXUtnFEMI@bucket/k; "
            "postgresql://mlflow:pw@db:5432/mlflow; https://ghp_token123@github.com/o/r.git; "
            "mail alice@example.com, git@github.com:o/r.git, password hunter22, profile tiny-secretless")
    assert redact(text) == (
        "GET https://***@mirror.example/x failed; s3://***@bucket/k; postgresql://***@db:5432/mlflow; "
        "https://***@github.com/o/r.git; mail alice@example.com, git@github.com:o/r.git, password ***, "
        "profile tiny-secretless")


@contextmanager
def basic_auth_server(root: Path, user: str, password: str) -> Iterator[tuple[str, list[str | None]]]:
    """Serve ``root`` on 127.0.0.1, answering 401 without the right basic auth; yield (URL, auth headers seen)."""
    expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
            pass

        def do_GET(self) -> None:  # noqa: N802
            seen.append(self.headers.get("Authorization"))
            path = root.joinpath(*[p for p in self.path.split("/") if p not in ("", "..")])
            status = 401 if seen[-1] != expected else 200 if path.is_file() else 404
            data = path.read_bytes() if status == 200 else b""
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def _stage(stage: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"pipeline.{stage}", "--params", "params.yaml"], check=False,
                          cwd=cwd, capture_output=True, text=True, timeout=120, env={**os.environ, **env})


def _files_holding(root: Path, secret: str) -> list[str]:
    """Files under ``root`` whose name or content holds ``secret``."""
    return [str(p) for p in root.rglob("*") if secret in str(p) or (p.is_file() and secret.encode() in p.read_bytes())]


def test_mirror_credentials_are_sent_but_never_printed_or_stored(tmp_path: Path, repo_root: Path) -> None:
    write_params(tmp_path / "work", repo_root)
    mirror = multi30k_mirror(tmp_path / "mirror")
    cache = tmp_path / "work" / "cache"
    with basic_auth_server(mirror, "alice", SECRET) as (url, seen):
        host = url.removeprefix("http://")
        env = {"NMT_DATA_MIRROR": f"http://alice:{SECRET}@{host}", "NMT_DOWNLOAD_CACHE": str(cache),
               "NMT_DOWNLOAD_BACKOFF_S": "0.01"}
        ok = _stage("download", tmp_path / "work", env)
        assert ok.returncode == 0, ok.stderr
        assert set(seen) == {"Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode()}
        bad = _stage("download", tmp_path / "work", env | {"NMT_DATA_MIRROR": f"http://alice:wrong-{SECRET}@{host}",
                                                           "NMT_DOWNLOAD_CACHE": str(tmp_path / "work" / "cache2")})
    assert bad.returncode == EXIT_PERMANENT  # a 4xx: no retry helps
    assert bad.stderr.strip().splitlines()[-1] == (
        f"error: stage download: {url}/multi30k/data/task1/raw/train.en.gz: HTTP 401 Unauthorized; check the URL "
        "(or NMT_DATA_MIRROR)")
    for proc in (ok, bad):
        assert SECRET not in proc.stdout + proc.stderr
    assert _files_holding(tmp_path / "work", SECRET) == []  # manifest, metrics, cache paths and contents


def test_tracking_credentials_never_reach_the_stage_output(tmp_path: Path, repo_root: Path) -> None:
    write_params(tmp_path, repo_root)
    write_raw(tmp_path / "data/tiny/raw", 50)
    env = {"NMT_TRACKING": "on", "MLFLOW_TRACKING_URI": f"http://bob:{SECRET}@127.0.0.1:9",
           "MLFLOW_TRACKING_PASSWORD": SECRET, "MLFLOW_TRACKING_TOKEN": f"tok-{SECRET}",
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    proc = _stage("clean", tmp_path, env)  # the server is unreachable: the stage fails, naming it
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stage clean: ") and "http://***@127.0.0.1:9" in last
    assert SECRET not in proc.stdout + proc.stderr
    assert _files_holding(tmp_path, SECRET) == []
