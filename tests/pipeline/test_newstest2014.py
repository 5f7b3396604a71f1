"""newstest2014 full through the real stages: every one of its 3,003 lines survives to the hypotheses.

Uses the shared data folder as the download mirror (skipped without it). Train is a stand-in
(newstest2012): the WMT14 training corpora are not in the mirror.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeline.clean import stage as clean_stage
from pipeline.core.config import CleanConfig, DownloadConfig, EncodeConfig, EvaluateConfig
from pipeline.core.data_details import PairCounts
from pipeline.core.textio import count_lines
from pipeline.data.sources import STATMT, WMT14, Corpus, SourceFile
from pipeline.download import stage as download_stage
from pipeline.encode import stage as encode_stage
from pipeline.evaluate import stage as evaluate_stage
from tests.helpers.models import make_averaged
from tests.helpers.paths import SHARED

pytestmark = pytest.mark.skipif(not (SHARED / "wmt14/test-full").is_dir(), reason="needs the shared data folder")

STAND_IN = Corpus(name="newstest2012", lines=3003,
                  en=SourceFile(url=f"{STATMT}/wmt14/dev.tgz", path="dev/newstest2012.en", archive=True),
                  de=SourceFile(url=f"{STATMT}/wmt14/dev.tgz", path="dev/newstest2012.de", archive=True))


@pytest.mark.slow
def test_newstest2014_keeps_all_3003_lines_from_download_to_bleu(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NMT_DATA_MIRROR", str(SHARED))
    monkeypatch.setenv("NMT_DATA_WORKERS", "1")
    spec = dataclasses.replace(WMT14, train=(STAND_IN,))
    download_stage(DownloadConfig(dataset="wmt14"), raw_dir=tmp_path / "raw", sources=spec)
    clean = clean_stage(CleanConfig(), raw_dir=tmp_path / "raw", clean_dir=tmp_path / "clean")
    assert clean.test == PairCounts(pairs_in=3003, pairs_out=3003, blank=0)
    assert clean.valid == PairCounts(pairs_in=3000, pairs_out=3000, blank=0)

    make_averaged(tmp_path)  # a random tiny model with its own BPE in tmp_path/bpe
    encode_stage(EncodeConfig(max_len=8, shard_rows=1000), clean_dir=tmp_path / "clean", bpe_dir=tmp_path / "bpe",
                 shards_dir=tmp_path / "shards")
    manifest = json.loads((tmp_path / "shards/manifest.json").read_text())
    assert manifest["splits"]["test"]["rows"] == 3003  # max_len=8 drops train pairs only

    cfg = EvaluateConfig(beam_sizes=[1], alphas=[0.6], max_len_a=0.0, max_len_b=2, max_tokens=4000)
    bleu = evaluate_stage(cfg, model_dir=tmp_path / "model", shards_dir=tmp_path / "shards", raw_dir=tmp_path / "raw",
                          eval_dir=tmp_path / "eval", train_dir=tmp_path / "train", spm_model=tmp_path / "bpe/spm.model")
    assert bleu.test.sentences == 3003 and count_lines(tmp_path / "eval/test.hyp.de") == 3003
    assert bleu.valid.sentences == 3000 and bleu.valid_newest.sentences == 3000
    # Scored against the untouched reference (what sacreBLEU's wmt14/full holds), not the cleaned text.
    assert (tmp_path / "raw/test.de").read_bytes() == (SHARED / "wmt14/test-full-txt/newstest2014.de").read_bytes()
