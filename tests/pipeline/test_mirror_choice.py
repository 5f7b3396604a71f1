"""Where the download stage finds its mirror, and how a download failure ends.

``make``, ``nmt run``, ``python -m flows.pipeline`` and ``dvc repro`` all run ``python -m pipeline.download`` in the
checkout, so the stage run there with a ``shared/data`` folder beside it is what each of them does. A failure no
retry fixes (a host name that does not resolve, a 404, a checksum mismatch) ends the stage at once with one line
and :data:`~pipeline.core.errors.EXIT_PERMANENT`; a transient one is retried by the stage.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.env import MirrorChoice, data_mirror
from pipeline.core.errors import EXIT_PERMANENT
from tests.helpers.data_faults import multi30k_mirror, write_params
from tests.helpers.httpserver import serve

TRAIN_EN = "multi30k/data/task1/raw/train.en.gz"


def _download(checkout: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python -m pipeline.download`` in ``checkout``, ``NMT_DATA_MIRROR`` unset unless ``env`` sets it."""
    base = {k: v for k, v in os.environ.items() if k != "NMT_DATA_MIRROR"}
    base.update({"NMT_TRACKING": "off", "NMT_DOWNLOAD_CACHE": str(checkout / "cache"), "NMT_DOWNLOAD_BACKOFF_S": "0"})
    return subprocess.run([sys.executable, "-m", "pipeline.download", "--params", "params.yaml"], cwd=checkout,
                          env={**base, **env}, capture_output=True, text=True, timeout=120, check=False)


def _verdict(proc: subprocess.CompletedProcess) -> str:
    """The failed stage's one error line (log lines start with a time); no traceback, no retry."""
    assert proc.returncode == EXIT_PERMANENT, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "retrying" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if not line[:1].isdigit()]
    assert len(errors) == 1 and errors[0].startswith("error: stage download: "), proc.stderr[-3000:]
    return errors[0]


def test_the_mirror_beside_the_checkout_is_used_unless_the_variable_says_otherwise(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    assert data_mirror(checkout, {}).location is None
    shared = tmp_path / "shared" / "data"
    shared.mkdir(parents=True)
    assert data_mirror(checkout, {}) == MirrorChoice(str(shared), "found beside the checkout, as NMT_DATA_MIRROR "
                                                                  "is unset")
    assert data_mirror(checkout, {"NMT_DATA_MIRROR": "file:///elsewhere"}) == MirrorChoice(
        "/elsewhere", "set by NMT_DATA_MIRROR")
    assert data_mirror(checkout, {"NMT_DATA_MIRROR": ""}) == MirrorChoice(None, "NMT_DATA_MIRROR is set but empty")


def test_the_stage_run_in_a_checkout_reads_the_shared_data_beside_it(tmp_path: Path, repo_root: Path) -> None:
    checkout = tmp_path / "checkout"
    write_params(checkout, repo_root)
    shared = multi30k_mirror(tmp_path / "shared" / "data")
    proc = _download(checkout, {})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"data mirror {shared} (found beside the checkout, as NMT_DATA_MIRROR is unset)" in proc.stderr
    assert not (checkout / "cache").exists() or not any((checkout / "cache").iterdir())  # nothing from upstream


def test_an_unresolvable_mirror_host_fails_at_once_in_one_line(tmp_path: Path, repo_root: Path) -> None:
    write_params(tmp_path, repo_root)
    line = _verdict(_download(tmp_path, {"NMT_DATA_MIRROR": "http://nonexistent.invalid/data"}))
    assert f"http://nonexistent.invalid/data/{TRAIN_EN}: host 'nonexistent.invalid' not found" in line
    assert "check NMT_DATA_MIRROR" in line


def test_a_mirror_checksum_mismatch_fails_at_once_in_one_line(tmp_path: Path, repo_root: Path) -> None:
    write_params(tmp_path, repo_root, download={"sha256": {"train.en.gz": "0" * 64}})
    mirror = multi30k_mirror(tmp_path / "mirror")
    line = _verdict(_download(tmp_path, {"NMT_DATA_MIRROR": str(mirror)}))
    assert "/train.en.gz: sha256 mismatch: got " in line and "expects 0000" in line
    assert line.endswith(f"the copy {mirror / TRAIN_EN} is corrupt: delete it and run again")


def test_http_mirror_retries_a_cut_transfer_but_not_a_404(tmp_path: Path, repo_root: Path) -> None:
    write_params(tmp_path, repo_root)
    mirror = multi30k_mirror(tmp_path / "mirror")
    with serve(mirror) as (url, faults):
        faults.drop_once.add(f"/{TRAIN_EN}")
        ok = _download(tmp_path, {"NMT_DATA_MIRROR": url})
        assert ok.returncode == 0, ok.stderr[-3000:]
        assert [status for path, _, status in faults.log if path == f"/{TRAIN_EN}"] == [200, 206]  # resumed
        (mirror / TRAIN_EN).unlink()
        faults.log.clear()
        line = _verdict(_download(tmp_path, {"NMT_DATA_MIRROR": url, "NMT_DOWNLOAD_CACHE": str(tmp_path / "c2")}))
    assert line == (f"error: stage download: NMT_DATA_MIRROR={url}: holds neither {TRAIN_EN} nor "
                    "multi30k/train.en.gz; add one of them to the mirror, or set NMT_DATA_MIRROR empty to download "
                    "https://github.com/multi30k/dataset/raw/master/data/task1/raw/train.en.gz")
    assert [path for path, _, _ in faults.log] == [f"/{TRAIN_EN}", "/multi30k/train.en.gz"]  # each once: no retry
