"""The evaluate stage's world: a random tiny averaged model, a newer checkpoint, clean/raw text and real shards.

:func:`build_eval_world` is what the ``eval_world`` fixture (tests/conftest.py) returns. ``train/``
holds two checkpoints as the train stage writes them: ``step-00000010`` (the one ``averaged.pt`` is
built from) and the newest, ``step-00000020``, with other random weights, so the evaluate stage's
newest-checkpoint figures differ from the averaged model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.config import EncodeConfig
from pipeline.core.owned import write_lines
from pipeline.encode import stage as encode_stage
from pipeline.tracking.harness import run_stage
from tests.helpers.models import CORPUS, make_averaged, spm_vocab_size, tiny_model, write_checkpoint

VALID = [("Gutach: Increased safety for pedestrians", "Gutach: Noch mehr Sicherheit für Fußgänger"),
         ("", ""),
         ("They are not even 100 metres apart.", "Sie stehen keine 100 Meter voneinander entfernt."),
         ("On Tuesday, the new traffic lights were put into operation.",
          "Am Dienstag ist die neue Ampel in Betrieb genommen worden."),
         ("The price is 3.50 euros.", "Der Preis liegt bei 3,50 Euro.")]
TEST = [("Yesterday, the mayor gave a clear answer to this question.",
         "Diese Frage hat der Bürgermeister gestern klar beantwortet."),
        ("Two sets of lights so close to one another: intentional or just a silly error?",
         "Zwei Anlagen so nah beieinander: Absicht oder Schildbürgerstreich?"),
        ("", "Leer."),
        ("the e-mail address is new", "die E-Mail-Adresse ist neu")]
AVERAGED_STEP, NEWEST_STEP = 10, 20


def build_eval_world(root: Path) -> Path:
    """averaged.pt (from train/step-00000010), a newer train/step-00000020, clean/raw text and shards
    encoded by the real encode stage, under ``root``."""
    make_averaged(root)  # writes train/step-00000010 and averages it alone
    newest = tiny_model(spm_vocab_size(root / "bpe" / "spm.model"), seed=1)
    write_checkpoint(root / "train", NEWEST_STEP, newest.state_dict(), newest.cfg.to_dict())
    pairs = {"train": list(zip(CORPUS[0::2], CORPUS[1::2])), "valid": VALID, "test": TEST}
    for split, rows in pairs.items():
        for side, lang in ((0, "en"), (1, "de")):
            write_lines(root / "clean" / f"{split}.{lang}", [r[side] for r in rows])
            write_lines(root / "raw" / f"{split}.{lang}", [r[side] for r in rows])
    mp = pytest.MonkeyPatch()
    mp.setenv("NMT_DATA_WORKERS", "1")
    try:
        run_stage("encode", lambda: encode_stage(EncodeConfig(max_len=64, shard_rows=2), clean_dir=root / "clean",
                                                 bpe_dir=root / "bpe", shards_dir=root / "shards"),
                  metrics_dir=root / "metrics")
    finally:
        mp.undo()
    return root
