"""benchmarks/memory.py counts a training step's live tensor bytes on fake tensors: the same count as the real
tensors give, what stays between steps is exactly the weights, buffers and Adam's state, and the count grows with
``NMT_MAX_TOKENS``."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from model import Transformer, TransformerConfig
from pipeline.training.forward import batch_loss
from tests.helpers.paths import REPO, load_benchmark

TINY = TransformerConfig(vocab_size=300, d_model=32, n_heads=2, d_ff=64, n_layers=1)
SHAPES = [(4, 65), (9, 32)]


def _blocks(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` in 512-byte blocks."""
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(-(-size // 512) * 512 for size in storages.values())


def test_fake_tensors_count_what_real_ones_do_and_the_resident_bytes_are_weights_buffers_and_adam() -> None:
    bench = load_benchmark("memory")
    fake = bench.step_bytes(TINY, SHAPES, label_smoothing=0.1)
    assert fake == bench.step_bytes(TINY, SHAPES, label_smoothing=0.1, fake=False)
    model = Transformer(TINY)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    src, tgt_in, tgt_out = (torch.randint(4, TINY.vocab_size, shape) for shape in [(2, 5)] * 3)
    batch_loss(model, src, tgt_in, tgt_out, 0.1)[0].backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    state = [t for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    peak, resident = fake
    assert resident == _blocks([*model.parameters(), *model.buffers(), *state])
    assert peak > resident


def test_the_script_counts_each_budget_of_a_profile_and_refuses_one_below_the_longest_pairs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("memory")
    out = tmp_path / "memory.json"
    assert bench.main(["--profile", "tiny", "--max-tokens", "300", "1200", "--out", str(out)]) == 0
    rows = json.loads(out.read_text(encoding="utf-8"))["rows"]
    assert [r["shapes"] for r in rows] == [[[4, 65], [9, 32]], [[18, 65], [37, 32]]]  # tiny: encode.max_len 64
    assert rows[0]["resident_bytes"] == rows[1]["resident_bytes"] < rows[0]["peak_bytes"] < rows[1]["peak_bytes"]
    assert "| 1200 | 18 x 65, 37 x 32 |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        bench.main(["--profile", "tiny", "--max-tokens", "64", "--out", str(out)])
    assert info.value.code == 2
    assert "--max-tokens 64 < 65: the longest pairs (encode.max_len + 1) need more" in capsys.readouterr().err


@contextlib.contextmanager
def _read_only_folder(tmp_path: Path) -> Iterator[Path]:
    """A read-only tmpfs mounted at ``tmp_path/ro`` (needs root: skipped elsewhere), unmounted after."""
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True,
                             check=False)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize(("args", "message"), [
    (["--out", "{tmp}"], "--out {tmp}: is a folder; name the .json file to write"),
    (["--out", "/dev/full"], "--out /dev/full: is not a regular file (a device or a FIFO); name the .json file to "
                             "write"),
    (["--out", "{ro}/memory.json"], "--out {ro}/memory.json: {ro} is not a writable folder (read-only file system or "
                                    "permissions); name a .json file in a folder you can write"),
])
def test_a_bad_out_is_one_line_before_any_counting(tmp_path: Path, args: list[str], message: str) -> None:
    """Each was a traceback (IsADirectoryError, OSError ENOSPC or EROFS) after the counting had run."""
    with contextlib.ExitStack() as stack:
        ro = stack.enter_context(_read_only_folder(tmp_path)) if "{ro}/memory.json" in args else tmp_path / "ro"
        fill = {"repo": REPO, "tmp": tmp_path, "ro": ro}
        argv = [a.format(**fill) for a in args]
        run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory.py"), "--max-tokens", "300",
                              *(["--profile", "tiny"] if "--profile" not in argv else []), *argv],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert (run.returncode, run.stdout) == (1, "")
        assert re.fullmatch(r"\d\d:\d\d:\d\d error: (.*)\n", run.stderr).group(1) == message.format(**fill)
        assert sorted(p.name for p in tmp_path.iterdir()) == (["ro"] if "{ro}/memory.json" in args else [])


@pytest.mark.parametrize("name", ["nosuch", "../profiles/tiny", "../sweeps/demo-seeds"])
def test_a_profile_name_outside_profiles_is_one_line(tmp_path: Path, name: str) -> None:
    """benchmarks/memory.py reads only a profile profiles/ lists (the rule of `nmt profile`)."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory.py"), "--profile", name,
                           "--max-tokens", "128", "--out", str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr.splitlines()) == (2, [
        f"error: --profile: {REPO / 'profiles'}: no such profile {name!r} (a file name of profiles/*.yaml "
        "without .yaml); known: demo, multi30k, paper, paper-big, tiny"])
    assert not (tmp_path / "out.json").exists()
