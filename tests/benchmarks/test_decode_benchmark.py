"""benchmarks/decode.py drives the real decoding code (this project's search, the CTranslate2 export and
``nmt translate``), so it cannot silently fall behind their signatures: every row on a tiny model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pipeline.inference import ct2
from pipeline.inference.decoding import load_translator
from tests.helpers.models import CORPUS, make_averaged
from tests.helpers.paths import load_benchmark


@pytest.mark.slow
def test_every_row_of_the_decoding_benchmark_runs_on_a_tiny_model(tmp_path: Path) -> None:
    bench = load_benchmark("decode")
    model = make_averaged(tmp_path, seed=2)
    exports = {q: ct2.export(model, tmp_path / q, q) for q in ("float32", "int8")}
    threads = torch.get_num_threads()
    try:
        rows = bench.measure_set(load_translator(model, "cpu"), exports, CORPUS[1::2][:6], CORPUS[0::2][:6],
                                 threads=[1, 2], single_limit=2)
    finally:
        torch.set_num_threads(threads)
    engines = {(r["engine"], r["layout"], r.get("max_tokens")) for r in rows}
    assert {("torch batched", f"1x{t}", m) for t in (1, 2) for m in bench.TORCH_MAX_TOKENS} <= engines
    assert {("ctranslate2 int8", "2x1", m) for m in bench.CT2_MAX_TOKENS} <= engines
    assert {"torch one at a time", "ctranslate2 float32", "ctranslate2 int8", "ctranslate2 float32, alpha 0"} <= {
        e for e, _, _ in engines}
    for r in rows:
        assert r["sentences"] in (2, 6) and r["sent_per_s"] > 0 and 0 <= r["bleu"] <= 100
        if r["engine"].startswith("torch"):  # any batching and any thread count: the same outputs
            assert r["same_as_batched"] == 1.0, r


@pytest.mark.slow
def test_the_process_mode_times_nmt_translate_beside_a_plain_script_and_sees_no_torch(tmp_path: Path) -> None:
    bench = load_benchmark("decode")
    export = ct2.export(make_averaged(tmp_path, seed=2), tmp_path / "ct2")
    result = bench.measure_processes(export, CORPUS[1::2][:6], repeats=1)
    assert result["sentences"] == 6 and set(result["seconds"]) == {bench.NMT_CT2, bench.PLAIN}
    assert all(s > 0 for s in result["seconds"].values()) and result["ratio"] > 0
    assert result["nmt_imports_torch"] is False
    assert bench.imports_torch([sys.executable, "-c", "import torch"])  # the probe sees torch where it is imported


def test_rows_run_in_rounds_and_each_counts_its_fastest_run() -> None:
    bench = load_benchmark("decode")
    bench.REPEATS = 3
    calls: list[str] = []

    def row(name: str, slow_call: int) -> object:
        def run() -> tuple[float, list[list[int]]]:
            calls.append(name)
            return (5.0 if calls.count(name) == slow_call else 1.0 + len(calls)), [[len(name)]]
        return bench.Row({"engine": name}, run)

    rows = [row("a", 1), row("bb", 3)]
    bench.in_rounds(rows)
    assert calls == ["a", "bb"] * 3  # round-robin, not one row's repeats back to back
    assert [r.seconds for r in rows] == [4.0, 3.0] and [r.hyps for r in rows] == [[[1]], [[2]]]


def test_repeats_below_one_is_refused_before_any_work(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_benchmark("decode").main(["--model", "demo=missing.pt", "--repeats", "0"])
    assert exit_info.value.code == 2 and "--repeats must be >= 1, got 0" in capsys.readouterr().err


def test_an_unknown_set_is_refused_before_any_work(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_benchmark("decode").main(["--model", "demo=missing.pt", "--sets", "multi30k-test,multi30k"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "unknown set(s) multi30k; use multi30k-test, newstest2014" in err
