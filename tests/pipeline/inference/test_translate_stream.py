"""``nmt translate`` on standard input: lines are translated as they arrive (interactive use), in chunks
that give the same outputs as translating the whole input at once, with either engine."""

from __future__ import annotations

import concurrent.futures
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.inference import ct2
from pipeline.inference.decoding import load_translator
from pipeline.inference.translate import decode_lines, split_lines, stream_chunks, translate_chunks, translate_lines
from tests.helpers.models import make_averaged
from tests.helpers.paths import REPO

INPUT = ("Gutach: Increased safety for pedestrians\n\nThey are not even 100 metres apart.\nBad ".encode()
         + b"\xff bytes\nThe price is 3.50 euros.\n" + " ".join(["Gutach safety"] * 60).encode()
         + b"\nYesterday, the mayor gave a clear answer.\nlast line without a newline")
SETTINGS = {"beam_size": 3, "alpha": 0.6, "max_len_a": 1.0, "max_len_b": 8, "max_tokens": 64}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stream")
    model = make_averaged(root, seed=6, n_layers=2)
    return {"torch": model, "ctranslate2": ct2.export(model, root / "ct2")}


def _pipe(data: bytes, *, close: bool = True) -> tuple[int, int]:
    read_fd, write_fd = os.pipe()
    os.write(write_fd, data)
    if close:
        os.close(write_fd)
    return read_fd, write_fd


def _next_within(chunks: Iterator[list[bytes]], write_fd: int, seconds: float = 10) -> list[bytes]:
    """The next chunk, failing (not hanging) when the reader waits for input although lines have arrived."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(next, chunks)
        try:
            return future.result(timeout=seconds)
        except concurrent.futures.TimeoutError:
            os.close(write_fd)  # ends the blocked read, so the thread can finish
            pytest.fail("stream_chunks waited for more input although complete lines had arrived")


def test_chunks_are_what_has_arrived_and_at_most_max_lines() -> None:
    read_fd, write_fd = _pipe(b"one\ntwo\nthr", close=False)
    chunks = stream_chunks(read_fd, max_lines=10)
    assert _next_within(chunks, write_fd) == [b"one", b"two"]  # nothing more ready: the complete lines so far
    os.write(write_fd, b"ee\nfour\n")
    assert _next_within(chunks, write_fd) == [b"three", b"four"]  # a line split across reads is joined
    os.write(write_fd, b"".join(b"%d\n" % i for i in range(25)) + b"tail")
    os.close(write_fd)
    sizes = [len(c) for c in chunks]
    assert sizes == [10, 10, 6]  # the bound, then the rest with the last line that has no newline
    os.close(read_fd)


@pytest.mark.parametrize("engine", ["torch", "ctranslate2"])
def test_chunked_translation_equals_whole_input_translation(models: dict[str, Path], engine: str) -> None:
    translator = load_translator(models[engine], "cpu") if engine == "torch" else ct2.load(models[engine])
    whole, _, _, _ = translate_lines(translator, decode_lines(split_lines(INPUT))[0], **SETTINGS)
    assert len(whole) == 8 and whole[1] == ""
    for max_lines in (1, 3, 100):
        read_fd, _ = _pipe(INPUT)
        chunks, out = [], []
        n = translate_chunks(translator, (chunks.append(c) or c for c in stream_chunks(read_fd, max_lines)),
                             out.extend, **SETTINGS)
        os.close(read_fd)
        assert n == 8 and out == whole, max_lines
        assert [len(c) for c in chunks][:-1] == [max_lines] * (len(chunks) - 1)


def _as_foreground() -> None:
    """SIGINT at its default, as in a terminal's foreground job: a background job (a pytest started with ``&``)
    inherits it ignored, and Python then raises no KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "translate", *args], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_as_foreground)


def _readline(stream, timeout: float) -> bytes:  # noqa: ANN001 - a pipe's binary reader
    fd, deadline, data = stream.fileno(), time.monotonic() + timeout, b""
    while not data.endswith(b"\n") and select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(fd, 1)
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.parametrize("engine", ["torch", "ctranslate2"])
def test_one_line_is_answered_while_stdin_stays_open(models: dict[str, Path], engine: str) -> None:
    """The acceptance test of interactive use: one line in, its translation out, the pipe still open."""
    translator = load_translator(models[engine], "cpu") if engine == "torch" else ct2.load(models[engine])
    want = translate_lines(translator, ["The price is 3.50 euros."], **SETTINGS)[0][0]
    proc = _start("--engine", engine, "--model", str(models[engine]), "--beam", "3", "--max-len-b", "8",
                  "--max-tokens", "64")
    try:
        proc.stdin.write(b"The price is 3.50 euros.\n")
        proc.stdin.flush()
        assert _readline(proc.stdout, timeout=30) == want.encode() + b"\n"
        assert proc.poll() is None  # still waiting for more input
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()
        assert proc.stdout.read() == b""
    finally:
        proc.kill()
        proc.wait()


def test_ctrl_c_while_waiting_on_stdin_is_one_line_and_exit_130(models: dict[str, Path]) -> None:
    """Ctrl-C in interactive use once printed a 17-line traceback."""
    proc = _start("--model", str(models["torch"]), "--beam", "1", "--max-len-b", "4")
    try:
        proc.stdin.write(b"The price is new.\n")
        proc.stdin.flush()
        assert _readline(proc.stdout, timeout=30).endswith(b"\n")  # loaded, answered, waiting for the next line
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        lines = [line for line in proc.stderr.read().decode().splitlines() if " INFO " not in line]  # progress
        assert lines == ["error: nmt translate: interrupted by Ctrl-C; no output file was left half-written"]
    finally:
        proc.kill()
        proc.wait()


def test_output_file_is_written_only_at_the_end(models: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out.de"
    proc = _start("--model", str(models["torch"]), "--output", str(out), "--max-len-b", "8")
    try:
        proc.stdin.write(b"The price is new.\n")
        proc.stdin.flush()
        progress = _readline(proc.stderr, timeout=30)  # the search's progress line: the chunk is translated
        assert b"translate beam 4: 1/1 sentences" in progress, progress
        assert not out.exists() and not list(tmp_path.iterdir())
        proc.stdin.write(b"Yesterday.\n")
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()
    finally:
        proc.kill()
        proc.wait()
    assert len(out.read_text(encoding="utf-8").splitlines()) == 2


@pytest.mark.slow
def test_an_attention_line_that_never_arrives_is_refused_at_end_of_input(models: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    png, out = tmp_path / "a.png", tmp_path / "out.de"
    for output in ([], ["--output", str(out)]):
        proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "translate", "--model", str(models["torch"]),
                               "--max-len-b", "4", "--attention-png", str(png), "--attention-line", "3", *output],
                              input=b"One.\nTwo.\n", capture_output=True, cwd=REPO, timeout=120)
        assert proc.returncode == 1
        assert proc.stderr.decode().splitlines()[-1] == ("error: --attention-line 3: the input ended after 2 line(s); "
                                                         "nothing drawn")
        assert proc.stdout.count(b"\n") == (0 if output else 2)  # stdout had the translations as they came
    assert not png.exists() and not out.exists()  # no PNG, and an --output file is not written half
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "translate", "--model", str(models["torch"]),
                           "--max-len-b", "4", "--attention-png", str(png), "--attention-line", "2"],
                          input=b"One.\n\nThree.\n", capture_output=True, cwd=REPO, timeout=120)
    assert proc.returncode == 1 and not png.exists()
    assert proc.stderr.decode().splitlines()[-1] == ("error: --attention-line 2: input line 2 is empty; choose a "
                                                     "non-empty line")
