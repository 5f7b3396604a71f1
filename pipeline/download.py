"""Stage ``download``: a dataset's parallel text into ``<paths.raw>/{train,valid,test}.{en,de}``, from
``NMT_DATA_MIRROR`` or upstream (:mod:`pipeline.data.locate`), the same bytes either way."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from pipeline import tracking
from pipeline.core.config import DownloadConfig
from pipeline.core.data_details import DownloadDetails
from pipeline.core.owned import atomic_path, scratch_folder
from pipeline.data.locate import FetchEnv, locate
from pipeline.data.raw import expectations, write_raw
from pipeline.data.sources import DatasetSpec, dataset_spec
from pipeline.tracking.harness import stage_main

log = logging.getLogger(__name__)


def stage(cfg: DownloadConfig, *, raw_dir: Path, sources: DatasetSpec | None = None) -> DownloadDetails:
    """Download ``cfg.dataset`` (or the table ``sources``) into ``raw_dir``, replaced whole; return the dataset, pairs
    per split, where each file came from, and the archives' sizes and sha256s.

    Raises:
        DownloadError: unreachable/missing source, corrupt archive, checksum or line-count mismatch.
        ConfigError: bad ``download.sha256`` entries.
    """
    raw_dir = Path(raw_dir)
    spec = sources or dataset_spec(cfg.dataset)
    env = FetchEnv.from_env(cfg)
    expected = expectations(cfg, spec, raw_dir)
    env.cache_dir.mkdir(parents=True, exist_ok=True)
    with scratch_folder(env.cache_dir, "extract") as tmp:  # extracted corpora: gigabytes, deleted after
        located, archives = locate(env, spec, tmp, expected)
        with atomic_path(raw_dir, role="raw") as out_dir:
            out_dir.mkdir()
            pairs = write_raw(spec, located, out_dir, tmp, expected)
    tracking.current().log_metrics({f"{split}_pairs": n for split, n in pairs.items()})
    log.info("download: %s", ", ".join(f"{s} {n} pairs" for s, n in pairs.items()))
    return DownloadDetails(dataset=spec.name, pairs=pairs, archives=archives,
                           origins={sf.key: loc.origin for sf, loc in sorted(located.items(), key=lambda x: x[0].key)})


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m pipeline.download [--params params.yaml]``."""
    return stage_main("download", lambda params, _: stage(params.download, raw_dir=Path(params.paths.raw)), argv)


if __name__ == "__main__":
    sys.exit(main())
