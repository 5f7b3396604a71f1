"""benchmarks/decode.py drives the real CTranslate2 export and ``nmt translate``, so it cannot silently fall behind
their signatures: its ``process`` mode on a tiny model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipeline.inference import ct2
from tests.helpers.models import CORPUS, make_averaged
from tests.helpers.paths import load_benchmark


@pytest.mark.slow
def test_the_process_mode_times_nmt_translate_beside_a_plain_script_and_sees_no_torch(tmp_path: Path) -> None:
    bench = load_benchmark("decode")
    export = ct2.export(make_averaged(tmp_path, seed=2), tmp_path / "ct2")
    result = bench.measure_processes(export, CORPUS[1::2][:6], repeats=1)
    assert result["sentences"] == 6 and set(result["seconds"]) == {bench.NMT_CT2, bench.PLAIN}
    assert all(s > 0 for s in result["seconds"].values()) and result["ratio"] > 0
    assert result["nmt_imports_torch"] is False
    assert bench.imports_torch([sys.executable, "-c", "import torch"])  # the probe sees torch where it is imported


def test_repeats_below_one_is_refused_before_any_work(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_benchmark("decode").main(["process", "--export", "missing", "--repeats", "0"])
    assert exit_info.value.code == 2 and "--repeats must be >= 1, got 0" in capsys.readouterr().err
