"""Where each source file's bytes come from: the mirror (``NMT_DATA_MIRROR``, else ``../shared/data`` beside the
checkout: :func:`pipeline.core.env.data_mirror`; extracted, or its archive; a file it lacks is an error, never
silently downloaded), else the upstream URL through the download cache."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import requests

from pipeline.core.config import DownloadConfig
from pipeline.core.data_details import Archive
from pipeline.core.env import data_mirror
from pipeline.core.env import settings as env_settings
from pipeline.core.errors import DownloadError, PermanentDownloadError
from pipeline.core.owned import discard
from pipeline.core.textio import sha256_file
from pipeline.core.write_errors import newest_file, write_error
from pipeline.data.archives import CorruptArchive, extract_members
from pipeline.data.fetch import HostNotFound, NotFound, RetryPolicy, Unreachable, cache_path, fetch_url
from pipeline.data.sources import DatasetSpec, SourceFile

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class FetchEnv:
    """Machine-dependent settings, from the environment (never params, so dvc.lock stays portable)."""

    mirror: str | None
    cache_dir: Path
    policy: RetryPolicy
    auth: tuple[str, str] | None = None  # from user:password@ in an http(s) mirror URL; never logged

    @classmethod
    def from_env(cls, cfg: DownloadConfig, root: Path = Path(".")) -> FetchEnv:
        """Read the ``NMT_*`` download settings and log which mirror the checkout ``root`` uses and why;
        ``user:pass@`` in an http(s) mirror becomes basic auth, so URLs in logs, errors and cache paths never carry
        it.

        Raises:
            PermanentDownloadError: the mirror is neither an existing folder nor a valid http(s) URL.
        """
        env, choice = env_settings(), data_mirror(root)
        mirror = choice.location  # a file:// prefix is already stripped
        auth = None
        if mirror and re.match(r"^https?://", mirror):
            _check_mirror_url(mirror)
            mirror, auth = split_userinfo(mirror)
        elif mirror and not Path(mirror).is_dir():
            raise PermanentDownloadError(f"NMT_DATA_MIRROR={split_userinfo(mirror)[0]!r} is neither a directory "
                                         "nor an http(s) URL; fix or unset it")
        if mirror:
            log.info("data mirror %s (%s)", mirror, choice.reason)
        else:
            log.info("no data mirror (%s): downloading from the upstream URLs", choice.reason)
        return cls(mirror=mirror, cache_dir=env.download_cache, auth=auth,
                   policy=RetryPolicy(retries=cfg.retries, timeout_s=cfg.timeout_s, backoff_s=env.download_backoff_s))

    def fetch(self, url: str, dest: Path) -> Path:
        """:func:`fetch_url` with the mirror's credentials; a full disk names the ``.part`` file being written."""
        with requests.Session() as session:
            session.auth = self.auth if self.mirror and url.startswith(self.mirror.rstrip("/") + "/") else None
            try:
                return fetch_url(url, dest, policy=self.policy, session=session)
            except OSError as exc:
                raise write_error(exc, exc.filename or dest.with_name(dest.name + ".part")) or exc from None


def _check_mirror_url(url: str) -> None:
    """Refuse an http(s) mirror URL that ``urllib`` cannot take apart (``http://[::1``, a bad port, no host)."""
    try:
        parts = urlsplit(url)
        problem = None if parts.hostname else "it has no host"
        _ = parts.port  # a port that is not a number in 0..65535 raises here
    except ValueError as exc:
        problem = str(exc)
    if problem:
        shown = re.sub(r"^(https?://)[^/]*@", r"\1***@", url)
        raise PermanentDownloadError(f"NMT_DATA_MIRROR={shown!r} is not a valid URL ({problem}); set it to a folder "
                                     "or an http(s) base URL such as https://host/data, or unset it")


def split_userinfo(url: str) -> tuple[str, tuple[str, str] | None]:
    """``url`` without its ``user:password@`` part, and the (user, password) it held (None if none)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=host)), (unquote(user), unquote(password))


@dataclass(frozen=True)
class Expectation:
    """An expected sha256 and who asked for it (for the error message)."""

    sha256: str
    where: str
    remedy: str


def check(path: Path, label: str, expected: list[Expectation], copy: Path) -> tuple[str, int]:
    """sha256 and size of ``path``; raise naming both hashes if an expectation disagrees."""
    digest, size = sha256_file(path), path.stat().st_size
    for exp in expected:
        if exp.sha256 != digest:
            raise PermanentDownloadError(f"{label}: sha256 mismatch: got {digest}, {exp.where} expects {exp.sha256}. "
                                         f"{exp.remedy}; otherwise the copy {copy} is corrupt: delete it and run again")
    return digest, size


@dataclass(frozen=True)
class Located:
    """A source file's bytes on local disk and where they came from."""

    path: Path  # for an archive member: extracted into the staging folder
    origin: str  # mirror, cache or network
    copy: Path  # the file a user would delete or replace to fix it (the archive, for a member)
    cached: bool  # whether copy lives in our download cache (then a corrupt one is deleted for them)

    def remedy(self) -> str:
        """What to do about a corrupt ``copy``."""
        if self.cached:
            return "the cached copy was deleted: run the stage again to download it anew"
        return f"replace the mirror's copy {self.copy} with a good one"

    def unpack(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args, remedy=...)``; a corrupt cached copy is deleted so that a rerun fetches it anew."""
        try:
            return fn(*args, remedy=self.remedy())
        except CorruptArchive:
            if self.cached:
                discard(self.copy)
            raise
        except OSError as exc:  # the staging copy (last argument) could not be written: disk full...
            dest = Path(args[-1])
            raise write_error(exc, exc.filename or (newest_file(dest) if dest.is_dir() else dest)) or exc from None


def _from_mirror(env: FetchEnv, rel: str) -> Located | None:
    """``<mirror>/<rel>`` as a local file (downloaded to the cache for an http mirror), or None."""
    if env.mirror is None:
        return None
    if not re.match(r"^https?://", env.mirror):
        path = Path(env.mirror).joinpath(*rel.split("/"))
        return Located(path, "mirror", path, cached=False) if path.is_file() else None
    url = f"{env.mirror.rstrip('/')}/{rel}"
    dest = cache_path(env.cache_dir, url)
    if not dest.is_file():
        try:
            env.fetch(url, dest)
        except NotFound:
            return None
        except (HostNotFound, Unreachable) as exc:
            raise type(exc)(f"{exc}; check NMT_DATA_MIRROR, or set it empty to download from upstream") from None
    return Located(dest, "mirror", dest, cached=True)


def _download_unit(env: FetchEnv, spec: DatasetSpec, sf: SourceFile) -> Located:
    """``sf``'s archive or plain file from the mirror (an error if it has neither), else from upstream."""
    tried, rel = f"{spec.name}/{sf.path}", f"{spec.name}/{sf.url_name}"
    if env.mirror is not None:
        if (found := _from_mirror(env, rel)) is None:
            looked = " nor ".join(dict.fromkeys((tried, rel)))
            raise PermanentDownloadError(f"NMT_DATA_MIRROR={env.mirror}: holds neither {looked}; add one of them to "
                                         f"the mirror, or set NMT_DATA_MIRROR empty to download {sf.url}")
        return found
    dest = cache_path(env.cache_dir, sf.url)
    if dest.is_file():
        log.info("using cached %s", dest)
        return Located(dest, "cache", dest, cached=True)
    try:
        return Located(env.fetch(sf.url, dest), "network", dest, cached=True)
    except (Unreachable, HostNotFound) as exc:
        raise type(exc)(f"{exc}; if this machine has no internet access, set NMT_DATA_MIRROR to a directory "
                            f"or http(s) URL holding {tried} or {rel}") from None


def locate(env: FetchEnv, spec: DatasetSpec, staging: Path, expected: dict[str, list[Expectation]]
           ) -> tuple[dict[SourceFile, Located], dict[str, Archive]]:
    """Every source file's bytes (archives checked against ``expected``), and per archive URL its record."""
    located: dict[SourceFile, Located] = {}
    by_archive: dict[str, list[SourceFile]] = {}
    for _, _, _, sf in spec.files():
        if sf in located or sf in by_archive.get(sf.url, []):
            continue
        if (found := _from_mirror(env, f"{spec.name}/{sf.path}")) is not None:
            located[sf] = found
        elif sf.archive:
            by_archive.setdefault(sf.url, []).append(sf)
        else:
            located[sf] = _download_unit(env, spec, sf)
    # fetch every archive before unpacking any, so one bad archive does not hold up the others' downloads
    wheres = {url: _download_unit(env, spec, files[0]) for url, files in by_archive.items()}
    archives: dict[str, Archive] = {}
    for url, files in by_archive.items():
        first, where = files[0], wheres[url]
        digest, size = check(where.path, first.url_name, expected.get(first.url_name, []), where.copy)
        archives[url] = Archive(sha256=digest, bytes=size, origin=where.origin)
        log.info("extracting %d member(s) from %s", len(files), where.path)
        out = where.unpack(extract_members, where.path, [sf.path for sf in files], staging / first.url_name)
        for sf in files:
            located[sf] = dataclasses.replace(where, path=out[sf.path])
    return located, archives
