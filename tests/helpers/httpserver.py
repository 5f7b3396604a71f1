"""A real HTTP file server on 127.0.0.1 for download tests: Range support and injectable faults.

``http.server.SimpleHTTPRequestHandler`` ignores ``Range``; this handler serves ``bytes=N-`` and
``bytes=N-M`` with 206, and can drop the connection mid-file once, answer an error status once, or
ignore ``Range`` altogether (answer 200 with the whole file), per path, or send slowly.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Faults:
    """Switches, keyed by URL path (``/wmt14/dev.tgz``); the ``*_once`` ones are consumed when used."""

    drop_once: set[str] = field(default_factory=set)       # send half the body, then close the socket
    status_once: dict[str, int] = field(default_factory=dict)  # answer this status once (e.g. 500)
    ignore_range: bool = False                              # always answer 200 with the whole file
    bytes_per_s: float | None = None                        # send bodies in 16 KiB chunks at this rate
    log: list[tuple[str, str | None, int]] = field(default_factory=list)  # (path, Range header, status)


def _handler(root: Path, faults: Faults, lock: threading.Lock) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet test output
            pass

        def _record(self, status: int) -> None:
            with lock:
                faults.log.append((self.path, self.headers.get("Range"), status))

        def _error(self, status: int) -> None:
            self._record(status)
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            with lock:
                status = faults.status_once.pop(self.path, None)
                drop = self.path in faults.drop_once
                faults.drop_once.discard(self.path)
            if status is not None:
                return self._error(status)
            path = root.joinpath(*[p for p in self.path.split("?")[0].split("/") if p not in ("", "..")])
            if not path.is_file():
                return self._error(404)
            data = path.read_bytes()
            start, end = 0, len(data) - 1
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
            partial = bool(match) and not faults.ignore_range
            if partial:
                start = int(match.group(1))
                end = min(int(match.group(2)), end) if match.group(2) else end
                if start >= len(data):
                    self._record(416)
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
            body = data[start:end + 1]
            self._record(206 if partial else 200)
            self.send_response(206 if partial else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            if partial:
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            self.end_headers()
            if drop:
                self.wfile.write(body[:len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if faults.bytes_per_s:
                try:
                    for i in range(0, len(body), 1 << 14):
                        self.wfile.write(body[i:i + (1 << 14)])
                        self.wfile.flush()
                        time.sleep((1 << 14) / faults.bytes_per_s)
                except (BrokenPipeError, ConnectionResetError):  # the client was killed mid-body
                    self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


@contextmanager
def serve(root: Path, faults: Faults | None = None) -> Iterator[tuple[str, Faults]]:
    """Serve ``root`` on an ephemeral 127.0.0.1 port in a thread; yield (base URL, faults)."""
    faults = faults or Faults()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(root, faults, threading.Lock()))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", faults
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
