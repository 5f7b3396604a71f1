"""The raw folder (``paths.raw``): each split's source files checked and concatenated, and ``manifest.json``
recording every file's sha256, size and lines; both depend only on the source files' bytes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from pipeline.core.config import DownloadConfig
from pipeline.core.errors import ConfigError, DataError, DownloadError
from pipeline.core.textio import read_lines
from pipeline.data.archives import gunzip
from pipeline.data.locate import Expectation, Located, check
from pipeline.data.sources import LANGS, SPLITS, Corpus, DatasetSpec, SourceFile, sgml_segments

MANIFEST = "manifest.json"


def expectations(cfg: DownloadConfig, spec: DatasetSpec, raw_dir: Path) -> dict[str, list[Expectation]]:
    """Expected sha256 by file name (params) and by ``url|path`` (the previous manifest in ``raw_dir``).

    Raises:
        ConfigError: a ``download.sha256`` key no file of ``spec`` has, or a value that is not a sha256.
        DownloadError: an unreadable previous manifest.
    """
    known = {n for _, _, _, sf in spec.files() for n in (*sf.names(), sf.url_name)}
    out: dict[str, list[Expectation]] = {}
    problems = []
    for name, digest in sorted(cfg.sha256.items()):
        if name not in known:
            problems.append(f"download.sha256.{name}: no file of dataset {spec.name} has this name "
                            f"(known: {', '.join(sorted(known))})")
        elif not re.fullmatch(r"[0-9a-f]{64}", digest):
            problems.append(f"download.sha256.{name}: {digest!r} is not a lowercase hex sha256")
        else:
            out.setdefault(name, []).append(Expectation(
                digest, f"params download.sha256.{name}",
                "If the upstream file really changed, update download.sha256 in params.yaml"))
    if problems:
        raise ConfigError("params.yaml", problems)
    manifest = raw_dir / MANIFEST
    if manifest.is_file():
        try:
            entries = json.loads(manifest.read_text(encoding="utf-8"))["files"]
            pinned = {(e["url"], e["member"]): e["sha256"] for e in entries}
        except (ValueError, KeyError, TypeError) as exc:
            raise DownloadError(f"{manifest}: unreadable previous manifest ({exc}); delete it and run again") from None
        for _, _, _, sf in spec.files():
            if digest := pinned.get((sf.url, sf.member)):
                out.setdefault(sf.key, []).append(Expectation(
                    digest, f"the previous run's {manifest}",
                    f"If the upstream file really changed, delete {manifest} to accept the new one"))
    return out


def _lines(sf: SourceFile, loc: Located, staging: Path) -> Iterator[str]:
    """The text lines of one source file (gzip decompressed, SGML parsed as sacreBLEU does)."""
    path = loc.path
    if sf.fmt == "gzip":
        path = loc.unpack(gunzip, path, staging / "gunzip" / sf.path.removesuffix(".gz"))
    lines = read_lines(path)
    try:
        yield from sgml_segments(lines) if sf.fmt == "sgm" else lines
    except DataError as exc:  # name the file a user can open, not the staging copy deleted on exit
        shown = f"{loc.copy} (member {sf.path})" if sf.archive else str(loc.copy)
        raise DataError(f"{sf.label}: {str(exc).replace(str(path), shown)}") from None


def _write_side(fh: IO[bytes], digest: Any, lines: Iterator[str]) -> int:
    n = 0
    for n, line in enumerate(lines, 1):
        data = line.encode("utf-8") + b"\n"
        fh.write(data)
        digest.update(data)
    return n


def _write_split(split: str, corpora: tuple[Corpus, ...], located: dict[SourceFile, Located], out_dir: Path,
                 staging: Path, expected: dict[str, list[Expectation]]
                 ) -> tuple[list[dict[str, str | int | None]], dict[str, dict[str, str | int]]]:
    """Write ``<split>.{en,de}``: the corpora concatenated, each checked; return manifest entries."""
    entries: list[dict[str, str | int | None]] = []
    paths = {lang: out_dir / f"{split}.{lang}" for lang in LANGS}
    digests = {lang: hashlib.sha256() for lang in LANGS}
    with contextlib.ExitStack() as stack:
        handles = {lang: stack.enter_context(open(paths[lang], "wb")) for lang in LANGS}
        for corpus in corpora:
            counts = {}
            for lang in LANGS:
                sf = corpus.side(lang)
                src = located[sf]
                pins = [e for n in dict.fromkeys((*sf.names(), sf.key)) for e in expected.get(n, [])]
                digest, size = check(src.path, sf.label, pins, src.copy)
                counts[lang] = _write_side(handles[lang], digests[lang], _lines(sf, src, staging))
                entries.append({"split": split, "corpus": corpus.name, "lang": lang, "url": sf.url,
                                "member": sf.member, "format": sf.fmt, "sha256": digest, "bytes": size,
                                "lines": counts[lang]})
            _check_counts(corpus, counts, {located[corpus.en].copy, located[corpus.de].copy})
    return entries, {path.name: {"sha256": digests[lang].hexdigest(), "bytes": path.stat().st_size,
                                 "lines": sum(e["lines"] for e in entries if e["lang"] == lang)}
                     for lang, path in paths.items()}


def _check_counts(corpus: Corpus, counts: dict[str, int], copies: set[Path]) -> None:
    en, de = corpus.en, corpus.de
    fix = f"delete or replace {', '.join(map(str, sorted(copies)))} and run again"
    if counts["en"] != counts["de"]:
        raise DownloadError(f"corpus {corpus.name}: {en.label} has {counts['en']} lines but {de.label} has "
                            f"{counts['de']}: the files are not aligned; {fix}")
    if corpus.lines is not None and counts["en"] != corpus.lines:
        raise DownloadError(f"corpus {corpus.name}: {en.label} and {de.label} have {counts['en']} lines, expected "
                            f"{corpus.lines}: the copy is incomplete or not the expected release; {fix}")


def write_raw(spec: DatasetSpec, located: dict[SourceFile, Located], out_dir: Path, staging: Path,
              expected: dict[str, list[Expectation]]) -> dict[str, int]:
    """Write every split of ``spec`` and ``manifest.json`` into the empty folder ``out_dir`` (gzip files decompressed
    in ``staging``); return the pairs of each split.

    Raises:
        DownloadError: a checksum or line-count mismatch, or a corrupt archive.
        DataError: a source file with invalid UTF-8 or a NUL byte (naming the file a user can open).
    """
    files: list[dict[str, str | int | None]] = []
    outputs: dict[str, dict[str, str | int]] = {}
    for split in SPLITS:
        entries, outs = _write_split(split, spec.split(split), located, out_dir, staging, expected)
        files += entries
        outputs.update(outs)
    manifest = {"dataset": spec.name, "files": files, "outputs": outputs}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return {split: outputs[f"{split}.en"]["lines"] for split in SPLITS}
