"""Getting bytes onto the disk reliably: HTTP with resume (``Range``) and retries with exponential backoff for
transient failures (a reset or cut connection, a timeout, HTTP 5xx/408/429); a failure that waiting cannot fix
(HTTP 4xx, a host that does not resolve, an invalid URL) ends it at once with a :class:`PermanentDownloadError`.

urllib3's :class:`~urllib3.util.Retry` counts the failures in a row and times the backoff; the resume is ours
because urllib3 retries a request from its first byte, while a cut transfer here goes on from the bytes already in
``dest.part``."""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import requests
import urllib3
from urllib3.util import Retry

from pipeline.core.errors import DownloadError, PermanentDownloadError
from pipeline.core.owned import discard, move_file

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
_LOG_EVERY_S = 15.0
_PERMANENT_REQUEST_ERRORS = (requests.exceptions.InvalidURL, requests.exceptions.MissingSchema,
                             requests.exceptions.InvalidSchema)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How hard to try: ``retries`` failed attempts in a row after the first, each request's ``timeout_s``, and
    ``backoff_s``, the factor of urllib3's :meth:`~urllib3.util.Retry.get_backoff_time` (the first retry at once,
    the n-th after ``backoff_s * 2 ** (n - 1)`` s, at most 60 s)."""

    retries: int = 5
    timeout_s: float = 60.0
    backoff_s: float = 1.0

    def fresh(self) -> Retry:
        """A urllib3 ``Retry`` with no failure counted yet: ``retries`` more failures allowed."""
        return Retry(total=self.retries, backoff_factor=self.backoff_s, backoff_max=60.0)


class NotFound(PermanentDownloadError):
    """The server answered 404/410."""


class Unreachable(DownloadError):
    """Every attempt failed with a transient error."""


class HostNotFound(PermanentDownloadError):
    """The host has no address (DNS lookup failed)."""


class _Transient(Exception):
    """A failure worth retrying."""


def cache_path(cache_dir: Path, url: str) -> Path:
    """Where ``url`` is cached: ``<cache_dir>/<host>/<url path>``."""
    parts = urlsplit(url)
    host = re.sub(r"[^A-Za-z0-9._-]", "_", parts.netloc) or "local"
    comps = [c for c in parts.path.split("/") if c not in ("", ".", "..")] or ["index"]
    return cache_dir.joinpath(host, *comps)


class _Progress:
    """A tqdm bar on a terminal, else a log line every ``_LOG_EVERY_S`` with rate and ETA."""

    def __init__(self, label: str, total: int | None, done: int) -> None:
        self.label, self.total, self.done = label, total, done
        self.start_done, self.t0 = done, time.monotonic()
        self.last_log = self.t0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, desc=label, leave=False)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last_log >= _LOG_EVERY_S:
            self.last_log = now
            rate = (self.done - self.start_done) / max(now - self.t0, 1e-9)
            if self.total:
                eta = (self.total - self.done) / rate if rate > 0 else float("inf")
                log.info("%s: %.1f/%.1f MB (%.0f%%), %.2f MB/s, ETA %.0f s", self.label, self.done / 1e6,
                         self.total / 1e6, 100.0 * self.done / self.total, rate / 1e6, eta)
            else:
                log.info("%s: %.1f MB, %.2f MB/s", self.label, self.done / 1e6, rate / 1e6)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _content_range(value: str | None) -> tuple[int | None, int | None]:
    """(first byte, total) from a ``Content-Range: bytes a-b/total`` header (None where absent)."""
    match = re.fullmatch(r"\s*bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)\s*", value or "")
    first, total = match.groups() if match else (None, None)
    return int(first) if first else None, int(total) if total and total != "*" else None


def _open(session: requests.Session, url: str, part: Path, timeout: float) -> tuple[requests.Response, int, int | None]:
    """Send the (range) request; return the response, the offset to write at (-1: complete) and the total size."""
    have = _size(part)
    headers = {"Accept-Encoding": "identity", **({"Range": f"bytes={have}-"} if have else {})}
    resp = session.get(url, headers=headers, stream=True, timeout=timeout, allow_redirects=True)
    status = resp.status_code
    if status not in (200, 206):
        resp.close()
    if status in (404, 410):
        raise NotFound(f"{url}: HTTP {status} (not found); check the URL or the mirror's layout")
    if status == 416:  # our range starts at or past the end: complete already, or a stale part
        _, total = _content_range(resp.headers.get("Content-Range"))
        if total is not None and total == have:
            return resp, -1, total
        discard(part)
        raise _Transient(f"HTTP 416 for a resume at byte {have}; restarting from scratch")
    if status >= 500 or status in (408, 429):
        raise _Transient(f"HTTP {status}")
    if status == 206:
        first, total = _content_range(resp.headers.get("Content-Range"))
        if first != have:
            resp.close()
            discard(part)
            raise _Transient(f"server resumed at byte {first}, not {have}; restarting from scratch")
        return resp, have, total
    if status == 200:
        if have:
            log.info("%s: server ignored the Range request; restarting the transfer", url)
        length = resp.headers.get("Content-Length")
        return resp, 0, int(length) if length and length.isdigit() else None
    error = PermanentDownloadError if 400 <= status < 500 else DownloadError
    raise error(f"{url}: HTTP {status} {resp.reason}; check the URL (or NMT_DATA_MIRROR)")


def _name_not_resolved(exc: BaseException | None, depth: int = 0) -> bool:
    """Whether ``exc`` (a requests/urllib3 error) comes from a failed DNS lookup."""
    if exc is None or depth > 4:
        return False
    if isinstance(exc, urllib3.exceptions.NameResolutionError):
        return True
    nested = [getattr(exc, "reason", None), exc.__cause__, *(a for a in exc.args if isinstance(a, BaseException))]
    return any(_name_not_resolved(e, depth + 1) for e in nested if e is not exc)


def _attempt(session: requests.Session, url: str, part: Path, timeout: float, label: str) -> None:
    """One try at completing ``part``; raises :class:`_Transient` for anything worth retrying."""
    try:
        resp, offset, total = _open(session, url, part, timeout)
    except _PERMANENT_REQUEST_ERRORS as exc:
        raise PermanentDownloadError(f"{url}: not a valid URL ({exc})") from None
    except (requests.RequestException, urllib3.exceptions.HTTPError) as exc:
        if _name_not_resolved(exc):
            raise HostNotFound(f"{url}: host {urlsplit(url).hostname!r} not found (DNS lookup failed); check the "
                               "host name and the network") from None
        raise _Transient(f"{type(exc).__name__}: {exc}") from None
    if offset < 0:
        return
    progress = _Progress(label, total, offset)
    try:
        with resp, open(part, "r+b" if offset else "wb") as fh:
            fh.seek(offset)
            fh.truncate()
            for chunk in resp.raw.stream(_CHUNK, decode_content=False):
                fh.write(chunk)
                progress.update(len(chunk))
    except (requests.RequestException, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError) as exc:
        raise _Transient(f"transfer interrupted at byte {progress.done}: {type(exc).__name__}") from None
    finally:
        progress.close()
    size = part.stat().st_size
    if total is not None and size != total:
        raise _Transient(f"truncated body: {size} of {total} bytes")


def fetch_url(url: str, dest: Path, *, policy: RetryPolicy, session: requests.Session) -> Path:
    """Download ``url`` to ``dest`` through ``dest.part``; return ``dest``. Gives up after ``policy.retries``
    failures in a row that added no bytes (an attempt that added bytes starts a fresh ``Retry``).

    Raises:
        NotFound, HostNotFound, Unreachable: see each; PermanentDownloadError: another HTTP 4xx or an invalid URL;
        DownloadError: another HTTP status.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    retry, attempts = policy.fresh(), 0
    while True:
        before = _size(part)
        attempts += 1
        try:
            _attempt(session, url, part, policy.timeout_s, dest.name)
            break
        except _Transient as exc:
            kept = _size(part)
            try:
                retry = policy.fresh() if kept > before else retry.increment(method="GET", url=url, error=exc)
            except urllib3.exceptions.MaxRetryError:
                raise Unreachable(f"{url}: could not download after {attempts} attempt(s): {exc}") from None
            log.warning("%s: %s; retrying in %.2g s (%d/%d failures in a row, %d bytes kept)", url, exc,
                        retry.get_backoff_time(), len(retry.history), policy.retries, kept)
            retry.sleep()
    move_file(part, dest)
    log.info("downloaded %s (%d bytes)", url, dest.stat().st_size)
    return dest


def _size(path: Path) -> int:
    """The size of ``path`` in bytes; 0 where it does not exist."""
    return path.stat().st_size if path.exists() else 0
