"""Stage ``download``: fetch a dataset's parallel text into ``<paths.raw>/{train,valid,test}.{en,de}``.

With ``NMT_DATA_MIRROR`` set, each source file is looked up, in order, as
``$NMT_DATA_MIRROR/<dataset>/<path>`` (an extracted file), then ``$NMT_DATA_MIRROR/<dataset>/<archive name>``;
a file in neither place is an error naming both (a mirror is never silently bypassed). Without a mirror,
each comes from its upstream URL (through the download cache ``$NMT_DOWNLOAD_CACHE``, default
``<repo>/.cache/downloads``). The outputs and
``manifest.json`` depend only on the files' bytes, never on where they were found, so a mirror run
and a network run are byte-identical. The whole raw folder is built under a temporary sibling and
renamed into place: a failure leaves the previous outputs (or nothing) behind.

Environment: ``NMT_DATA_MIRROR`` (a folder or http(s) base URL; ``user:password@`` in it is sent as
basic auth and never logged), ``NMT_DOWNLOAD_CACHE``,
``NMT_DOWNLOAD_BACKOFF_S`` (first retry delay, default 1 s, doubling); parsed in :mod:`pipeline.core.env`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import requests

from pipeline.core import tracking
from pipeline.core.config import DownloadConfig, Params
from pipeline.core.env import settings as env_settings
from pipeline.core.errors import ConfigError, DataError, DownloadError
from pipeline.core.stage import stage_main
from pipeline.core.textio import atomic_path, newest_file, pid_alive, read_lines, write_error
from pipeline.data.fetch import (
    CorruptArchive,
    HostNotFound,
    NotFound,
    RetryPolicy,
    Unreachable,
    extract_members,
    fetch_url,
    gunzip,
    sha256_file,
)
from pipeline.data.fetch import cache_path as _cache_path
from pipeline.data.sources import LANGS, SPLITS, Corpus, DatasetSpec, SourceFile, dataset_spec, sgml_segments

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


@dataclass(frozen=True, kw_only=True)
class FetchEnv:
    """Machine-dependent settings, from the environment (never params, so dvc.lock stays portable)."""

    mirror: str | None
    cache_dir: Path
    policy: RetryPolicy
    auth: tuple[str, str] | None = None  # from user:password@ in an http(s) mirror URL; never logged

    @classmethod
    def from_env(cls, cfg: DownloadConfig) -> FetchEnv:
        """Read ``NMT_DATA_MIRROR``, ``NMT_DOWNLOAD_CACHE`` and ``NMT_DOWNLOAD_BACKOFF_S``.

        Credentials in an http(s) mirror URL (``https://user:pass@host/data``) are taken out of it
        and sent as HTTP basic auth, so URLs in logs, errors and cache paths never carry them.

        Raises:
            ConfigError: a malformed ``NMT_*`` variable (named, with what is expected).
            DownloadError: the mirror is neither an existing folder nor a valid http(s) URL.
        """
        env = env_settings()
        mirror = env.data_mirror  # a file:// prefix is already stripped
        auth = None
        if mirror and re.match(r"^https?://", mirror):
            _check_mirror_url(mirror)
            mirror, auth = split_userinfo(mirror)
        elif mirror and not Path(mirror).is_dir():
            raise DownloadError(f"NMT_DATA_MIRROR={split_userinfo(mirror)[0]!r} is neither a directory nor an "
                                "http(s) URL; fix or unset it")
        return cls(mirror=mirror, cache_dir=env.download_cache, auth=auth,
                   policy=RetryPolicy(retries=cfg.retries, timeout_s=cfg.timeout_s, backoff_s=env.download_backoff_s))


def _check_mirror_url(url: str) -> None:
    """Refuse an http(s) mirror URL that ``urllib`` cannot take apart (``http://[::1``, a bad port, no host).

    Raises:
        DownloadError: naming ``NMT_DATA_MIRROR`` and the URL (any ``user:password@`` masked).
    """
    try:
        parts = urlsplit(url)
        problem = None if parts.hostname else "it has no host"
        _ = parts.port  # a port that is not a number in 0..65535 raises here
    except ValueError as exc:
        problem = str(exc)
    if problem:
        shown = re.sub(r"^(https?://)[^/]*@", r"\1***@", url)
        raise DownloadError(f"NMT_DATA_MIRROR={shown!r} is not a valid URL ({problem}); set it to a folder or an "
                            "http(s) base URL such as https://host/data, or unset it")


def split_userinfo(url: str) -> tuple[str, tuple[str, str] | None]:
    """``url`` without its ``user:password@`` part, and the (user, password) it held (None if none)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=host)), (unquote(user), unquote(password))


def _fetch(env: FetchEnv, url: str, dest: Path) -> Path:
    """:func:`fetch_url` with the mirror's credentials; a full disk names the ``.part`` file being written."""
    with requests.Session() as session:
        session.auth = env.auth if env.mirror and url.startswith(env.mirror.rstrip("/") + "/") else None
        try:
            return fetch_url(url, dest, policy=env.policy, session=session)
        except OSError as exc:
            raise write_error(exc, exc.filename or dest.with_name(dest.name + ".part")) or exc from None


def remove_stale_staging(cache_dir: Path) -> None:
    """Delete ``extract-<pid>-*`` staging folders of killed runs (extracted corpora: gigabytes)."""
    if not cache_dir.is_dir():
        return
    for entry in cache_dir.iterdir():
        match = re.fullmatch(r"extract-(\d+)-\w+", entry.name)
        if match and entry.is_dir() and not pid_alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            log.info("removed %s, left behind by an interrupted run", entry)


@dataclass(frozen=True)
class Expectation:
    """An expected sha256 and who asked for it (for the error message)."""

    sha256: str
    where: str
    remedy: str


@dataclass(frozen=True)
class Located:
    """A source file's bytes on local disk and where they came from.

    Attributes:
        path: the file's bytes (for an archive member: extracted into the staging folder).
        origin: ``mirror``, ``cache`` or ``network``.
        copy: the file a user would delete or replace to fix it (the archive, for a member).
        cached: whether ``copy`` lives in our download cache (then a corrupt one is deleted for them).
    """

    path: Path
    origin: str
    copy: Path
    cached: bool

    def remedy(self) -> str:
        """What to do about a corrupt ``copy``."""
        if self.cached:
            return "the cached copy was deleted: run the stage again to download it anew"
        return f"replace the mirror's copy {self.copy} with a good one"


def _mirror_hint(spec: DatasetSpec, sf: SourceFile) -> str:
    return (f"if this machine has no internet access, set NMT_DATA_MIRROR to a directory or http(s) URL "
            f"holding {spec.name}/{sf.path} or {spec.name}/{sf.url_name}")


def _check(path: Path, label: str, expected: list[Expectation], copy: Path) -> tuple[str, int]:
    """sha256 and size of ``path``; raise naming both hashes if an expectation disagrees."""
    digest, size = sha256_file(path)
    for exp in expected:
        if exp.sha256 != digest:
            raise DownloadError(f"{label}: sha256 mismatch: got {digest}, {exp.where} expects {exp.sha256}. "
                                f"{exp.remedy}; otherwise the copy {copy} is corrupt: delete it and run again")
    return digest, size


def _unpack(loc: Located, fn: Any, *args: Any) -> Any:
    """Run ``extract_members``/``gunzip`` on ``loc``; delete a corrupt cached copy so a rerun refetches it."""
    try:
        return fn(*args, remedy=loc.remedy())
    except CorruptArchive:
        if loc.cached:
            loc.copy.unlink(missing_ok=True)
        raise
    except OSError as exc:  # the staging copy (last argument) could not be written: disk full...
        dest = Path(args[-1])
        raise write_error(exc, exc.filename or (newest_file(dest) if dest.is_dir() else dest)) or exc from None


def _expectations(cfg: DownloadConfig, spec: DatasetSpec, raw_dir: Path) -> dict[str, list[Expectation]]:
    """Expected sha256 by file name (params) and by ``url|member`` (the previous manifest)."""
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
            digest = pinned.get((sf.url, _member(sf)))
            if digest:
                out.setdefault(_key(sf), []).append(Expectation(
                    digest, f"the previous run's {manifest}",
                    f"If the upstream file really changed, delete {manifest} to accept the new one"))
    return out


def _member(sf: SourceFile) -> str | None:
    return sf.path if sf.archive else None


def _key(sf: SourceFile) -> str:
    return f"{sf.url}|{sf.path}"


def _file_expectations(sf: SourceFile, expected: dict[str, list[Expectation]]) -> list[Expectation]:
    names = dict.fromkeys((*sf.names(), _key(sf)))
    return [e for n in names for e in expected.get(n, [])]


def _from_mirror(env: FetchEnv, rel: str) -> Located | None:
    """``<mirror>/<rel>`` as a local file (downloaded to the cache for an http mirror), or None."""
    if env.mirror is None:
        return None
    if not re.match(r"^https?://", env.mirror):
        path = Path(env.mirror).joinpath(*rel.split("/"))
        return Located(path, "mirror", path, cached=False) if path.is_file() else None
    url = f"{env.mirror.rstrip('/')}/{rel}"
    dest = _cache_path(env.cache_dir, url)
    if not dest.is_file():
        try:
            _fetch(env, url, dest)
        except NotFound:
            return None
        except (HostNotFound, Unreachable) as exc:
            raise DownloadError(f"{exc}; check NMT_DATA_MIRROR, or unset it to download from upstream") from None
    return Located(dest, "mirror", dest, cached=True)


def _from_mirror_or_upstream(env: FetchEnv, spec: DatasetSpec, sf: SourceFile, tried: str) -> Located:
    """``sf``'s download unit (its archive, or the plain file) from the mirror, else from upstream when no
    mirror is set; ``tried``: the ``<dataset>/<path>`` already looked for in the mirror.

    Raises:
        DownloadError: a mirror is set and holds neither ``tried`` nor ``<dataset>/<archive name>``.
    """
    if env.mirror is None:
        return _fetch_upstream(env, spec, sf)
    rel = f"{spec.name}/{sf.url_name}"
    found = _from_mirror(env, rel)
    if found is None:
        looked = " nor ".join(dict.fromkeys((tried, rel)))
        raise DownloadError(f"NMT_DATA_MIRROR={env.mirror}: holds neither {looked}; add one of them to the mirror, "
                            f"or unset NMT_DATA_MIRROR to download {sf.url}")
    return found


def _fetch_upstream(env: FetchEnv, spec: DatasetSpec, sf: SourceFile) -> Located:
    dest = _cache_path(env.cache_dir, sf.url)
    if dest.is_file():
        log.info("using cached %s", dest)
        return Located(dest, "cache", dest, cached=True)
    try:
        return Located(_fetch(env, sf.url, dest), "network", dest, cached=True)
    except (Unreachable, HostNotFound) as exc:
        raise DownloadError(f"{exc}; {_mirror_hint(spec, sf)}") from None


def _locate(env: FetchEnv, spec: DatasetSpec, staging: Path, archives: dict[str, dict[str, Any]],
            expected: dict[str, list[Expectation]]) -> dict[SourceFile, Located]:
    """Find every source file's bytes: mirror (extracted), mirror (archive); with no mirror, cache or network."""
    located: dict[SourceFile, Located] = {}
    by_archive: dict[str, list[SourceFile]] = {}
    for _, _, _, sf in spec.files():
        if sf in located or sf in by_archive.get(sf.url, []):
            continue
        found = _from_mirror(env, f"{spec.name}/{sf.path}")
        if found is not None:
            located[sf] = found
        elif sf.archive:
            by_archive.setdefault(sf.url, []).append(sf)
        else:
            located[sf] = _from_mirror_or_upstream(env, spec, sf, f"{spec.name}/{sf.path}")
    # fetch every archive before unpacking any, so one bad archive does not hold up the others' downloads
    wheres = {url: _from_mirror_or_upstream(env, spec, files[0], f"{spec.name}/{files[0].path}")
              for url, files in by_archive.items()}
    for url, files in by_archive.items():
        first, where = files[0], wheres[url]
        digest, size = _check(where.path, first.url_name, expected.get(first.url_name, []), where.copy)
        archives[url] = {"sha256": digest, "bytes": size, "origin": where.origin}
        log.info("extracting %d member(s) from %s", len(files), where.path)
        out = _unpack(where, extract_members, where.path, [sf.path for sf in files], staging / first.url_name)
        for sf in files:
            located[sf] = dataclasses.replace(where, path=out[sf.path])
    return located


def _lines(sf: SourceFile, loc: Located, staging: Path) -> Iterator[str]:
    """The text lines of one source file (gzip decompressed, SGML parsed as sacreBLEU does)."""
    path = loc.path
    if sf.fmt == "gzip":
        path = _unpack(loc, gunzip, path, staging / "gunzip" / sf.path.removesuffix(".gz"))
    lines = read_lines(path)
    try:
        yield from sgml_segments(lines) if sf.fmt == "sgm" else lines
    except DataError as exc:  # name the file a user can open, not the staging copy deleted on exit
        shown = f"{loc.copy} (member {sf.path})" if sf.archive else str(loc.copy)
        raise DataError(f"{sf.label}: {str(exc).replace(str(path), shown)}") from None


def _write_side(fh: Any, digest: Any, lines: Iterator[str]) -> int:
    n = 0
    for line in lines:
        data = line.encode("utf-8") + b"\n"
        fh.write(data)
        digest.update(data)
        n += 1
    return n


def _write_split(split: str, corpora: tuple[Corpus, ...], located: dict[SourceFile, Located], out_dir: Path,
                 staging: Path, expected: dict[str, list[Expectation]]) -> tuple[list[dict[str, Any]],
                                                                                 dict[str, Any]]:
    """Write ``<split>.{en,de}``: the corpora concatenated, each checked; return manifest entries."""
    entries: list[dict[str, Any]] = []
    outputs: dict[str, Any] = {}
    handles = {lang: open(out_dir / f"{split}.{lang}", "wb") for lang in LANGS}  # noqa: SIM115 - closed below
    digests = {lang: hashlib.sha256() for lang in LANGS}
    try:
        for corpus in corpora:
            counts = {}
            for lang in LANGS:
                sf = corpus.side(lang)
                src = located[sf]
                digest, size = _check(src.path, sf.label, _file_expectations(sf, expected), src.copy)
                counts[lang] = _write_side(handles[lang], digests[lang], _lines(sf, src, staging))
                entries.append({"split": split, "corpus": corpus.name, "lang": lang, "url": sf.url,
                                "member": _member(sf), "format": sf.fmt, "sha256": digest, "bytes": size,
                                "lines": counts[lang]})
            _check_counts(corpus, counts, {located[corpus.en].copy, located[corpus.de].copy})
    finally:
        for fh in handles.values():
            fh.close()
    for lang in LANGS:
        path = out_dir / f"{split}.{lang}"
        outputs[path.name] = {"sha256": digests[lang].hexdigest(), "bytes": path.stat().st_size,
                              "lines": sum(e["lines"] for e in entries if e["lang"] == lang)}
    return entries, outputs


def _check_counts(corpus: Corpus, counts: dict[str, int], copies: set[Path]) -> None:
    en, de = corpus.en, corpus.de
    fix = f"delete or replace {', '.join(map(str, sorted(copies)))} and run again"
    if counts["en"] != counts["de"]:
        raise DownloadError(f"corpus {corpus.name}: {en.label} has {counts['en']} lines but {de.label} has "
                            f"{counts['de']}: the files are not aligned; {fix}")
    if corpus.lines is not None and counts["en"] != corpus.lines:
        raise DownloadError(f"corpus {corpus.name}: {en.label} and {de.label} have {counts['en']} lines, expected "
                            f"{corpus.lines}: the copy is incomplete or not the expected release; {fix}")


def stage(cfg: DownloadConfig, *, raw_dir: Path, sources: DatasetSpec | None = None) -> dict:
    """Download ``cfg.dataset`` (or ``sources``) into ``raw_dir``.

    Args:
        cfg: the ``download`` section (dataset, retries, timeout, sha256 pins).
        raw_dir: output folder: ``{train,valid,test}.{en,de}`` and ``manifest.json``.
        sources: the dataset table; default :func:`pipeline.data.sources.dataset_spec` of ``cfg.dataset``.

    Returns:
        The dataset, pairs per split, where each file came from, and the archives' sizes and sha256s.

    Raises:
        DownloadError: unreachable/missing source, corrupt archive, checksum or line-count mismatch.
        ConfigError: bad ``download.sha256`` entries.
    """
    raw_dir = Path(raw_dir)
    spec = sources or dataset_spec(cfg.dataset)
    env = FetchEnv.from_env(cfg)
    expected = _expectations(cfg, spec, raw_dir)
    env.cache_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(env.cache_dir)
    archives: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(dir=env.cache_dir, prefix=f"extract-{os.getpid()}-") as tmp:
        staging = Path(tmp)
        located = _locate(env, spec, staging, archives, expected)
        files: list[dict[str, Any]] = []
        outputs: dict[str, Any] = {}
        with atomic_path(raw_dir, role="raw") as out_dir:
            out_dir.mkdir()
            for split in SPLITS:
                entries, outs = _write_split(split, spec.split(split), located, out_dir, staging, expected)
                files += entries
                outputs.update(outs)
            manifest = {"dataset": spec.name, "files": files, "outputs": outputs}
            (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    pairs = {split: outputs[f"{split}.en"]["lines"] for split in SPLITS}
    tracking.current().log_metrics({f"{split}_pairs": n for split, n in pairs.items()})
    log.info("download: %s", ", ".join(f"{s} {n} pairs" for s, n in pairs.items()))
    return {"dataset": spec.name, "pairs": pairs,
            "origins": {_key(sf): loc.origin for sf, loc in sorted(located.items(), key=lambda x: _key(x[0]))},
            "archives": archives}


def _run(params: Params, _args: Any) -> dict:
    return stage(params.download, raw_dir=Path(params.paths.raw))


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m pipeline.download [--params params.yaml]``."""
    return stage_main("download", _run, argv)


if __name__ == "__main__":
    sys.exit(main())
