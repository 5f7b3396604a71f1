"""Download stage: a real HTTP server on 127.0.0.1 serving tiny archives laid out like statmt's.

Covers the happy path, resume with Range, retries, corrupt archives, unsafe tar members, 404,
unreachable hosts, the mirror (local folder and HTTP), checksums, line counts, and lines holding
``\\r``, U+0085 or U+2028 (which ``str.splitlines`` would split).
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from pipeline.core.config import DownloadConfig
from pipeline.core.errors import EXIT_PERMANENT, ConfigError, DataError, DownloadError
from pipeline.core.textio import read_lines
from pipeline.data.sources import MULTI30K_SPEC, STATMT, WMT14, Corpus, DatasetSpec, SourceFile, sgml_segments
from pipeline.download import main, stage
from pipeline.tracking.harness import run_stage
from tests.helpers.httpserver import serve
from tests.helpers.paths import REPO, SHARED

ODD = ["carriage\rreturn inside", "next\x85line (NEL)", "line\u2028separator", "para\u2029separator"]


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NMT_DOWNLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("NMT_DOWNLOAD_BACKOFF_S", "0.01")
    monkeypatch.setenv("NMT_DATA_MIRROR", "")  # upstream, even where a shared/data folder lies beside the checkout


def _corpus_lines(name: str, lang: str, n: int) -> list[str]:
    lines = [f"{name} {lang} sentence {i} ü" for i in range(n)]
    if name == "europarl":
        lines[1:1 + len(ODD)] = [f"{lang}: {s}" for s in ODD]
    return lines


def _text(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode("utf-8")


def _sgm(lines: list[str], lang: str) -> bytes:
    segs = "".join(f'<seg id="{i + 1}">{s}</seg>\n' for i, s in enumerate(lines))
    return (f'<srcset setid="newstest2014" srclang="any">\n<doc sysid="ref" docid="d1" origlang="{lang}">\n'
            f"<p>\n{segs}</p>\n</doc>\n</srcset>\n").encode("utf-8")


def _tgz(path: Path, members: dict[str, bytes], extra: list[tarfile.TarInfo] = ()) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info)
    path.write_bytes(buf.getvalue())


TEST_EN = ["Gutach: Increased  safety &amp; pedestrians ", "  spaced\tout\u2028text ", "last &quot;one&quot;"]
TEST_DE = ["Gutach: Noch mehr Sicherheit", "weit\x85auseinander", "letzte"]
COUNTS = {"europarl": 8, "commoncrawl": 5, "news-commentary": 3, "newstest2013": 4}


def _statmt_tree(root: Path) -> dict[str, dict[str, list[str]]]:
    """Write statmt-shaped archives under ``root``; return the expected lines per corpus and lang."""
    c = {name: {lang: _corpus_lines(name, lang, n) for lang in ("en", "de")} for name, n in COUNTS.items()}
    noise = {"training/europarl-v7.fr-en.en": b"bonjour\n", "training/europarl-v7.fr-en.fr": b"salut\n"}
    _tgz(root / "wmt13/training-parallel-europarl-v7.tgz",
         {**noise, **{f"training/europarl-v7.de-en.{lg}": _text(c["europarl"][lg]) for lg in ("en", "de")}})
    _tgz(root / "wmt13/training-parallel-commoncrawl.tgz",
         {f"commoncrawl.de-en.{lg}": _text(c["commoncrawl"][lg]) for lg in ("en", "de")}
         | {"commoncrawl.de-en.annotation": b"x\n"})
    _tgz(root / "wmt14/training-parallel-nc-v9.tgz",
         {f"training/news-commentary-v9.de-en.{lg}": _text(c["news-commentary"][lg]) for lg in ("en", "de")})
    _tgz(root / "wmt14/dev.tgz", {f"dev/newstest2013.{lg}": _text(c["newstest2013"][lg]) for lg in ("en", "de")})
    _tgz(root / "wmt14/test-full.tgz", {"test-full/newstest2014-deen-src.en.sgm": _sgm(TEST_EN, "en"),
                                        "test-full/newstest2014-deen-ref.de.sgm": _sgm(TEST_DE, "de")})
    return c


def _spec(base: str, **line_overrides: int | None) -> DatasetSpec:
    """The real WMT14 table with statmt replaced by ``base`` and tiny expected counts."""
    counts = {"europarl-v7": 8, "commoncrawl": 5, "news-commentary-v9": 3, "newstest2013": 4,
              "newstest2014-full": 3, **line_overrides}

    def move(c: Corpus) -> Corpus:
        def side(sf: SourceFile) -> SourceFile:
            return dataclasses.replace(sf, url=sf.url.replace(STATMT, base))
        return dataclasses.replace(c, en=side(c.en), de=side(c.de), lines=counts[c.name])

    return dataclasses.replace(WMT14, train=tuple(map(move, WMT14.train)), valid=tuple(map(move, WMT14.valid)),
                               test=tuple(map(move, WMT14.test)))


def _run(tmp: Path, spec: DatasetSpec, **cfg: object) -> Path:
    raw = tmp / "raw"
    run_stage("download", lambda: stage(DownloadConfig(dataset="wmt14", **{"retries": 2, "timeout_s": 5.0, **cfg}),
                                        raw_dir=raw, sources=spec), metrics_dir=tmp / "metrics")
    return raw


def _outputs(raw: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(raw.iterdir())}


@pytest.fixture
def statmt(tmp_path: Path):
    root = tmp_path / "statmt"
    expected = _statmt_tree(root)
    with serve(root) as (base, faults):
        yield base, faults, expected, root


def _sacrebleu_sgm(data: bytes, tmp: Path) -> list[str]:
    """What sacreBLEU itself extracts from an SGML file (its own converter, not ours)."""
    from sacrebleu.dataset.fake_sgml import FakeSGMLDataset

    src, out = tmp / "in.sgm", tmp / "out.txt"
    src.write_bytes(data)
    object.__new__(FakeSGMLDataset)._convert_format(str(src), str(out))
    return list(read_lines(out))


def test_full_download_over_http(statmt, tmp_path: Path) -> None:
    base, faults, c, root = statmt
    raw = _run(tmp_path, _spec(base))
    assert sorted(os.listdir(raw)) == [".nmt-output", "manifest.json", "test.de", "test.en", "train.de", "train.en",
                                      "valid.de", "valid.en"]
    for lang in ("en", "de"):
        train = c["europarl"][lang] + c["commoncrawl"][lang] + c["news-commentary"][lang]
        assert (raw / f"train.{lang}").read_bytes() == _text(train)
        assert (raw / f"valid.{lang}").read_bytes() == _text(c["newstest2013"][lang])
    sgm_en = _sgm(TEST_EN, "en")
    assert list(read_lines(raw / "test.en")) == _sacrebleu_sgm(sgm_en, tmp_path) == list(
        sgml_segments(sgm_en.decode().split("\n")))
    assert list(read_lines(raw / "test.en"))[0] == "Gutach: Increased safety &amp; pedestrians"
    assert list(read_lines(raw / "test.de")) == _sacrebleu_sgm(_sgm(TEST_DE, "de"), tmp_path)
    manifest = json.loads((raw / "manifest.json").read_text())
    assert [(f["split"], f["corpus"], f["lang"]) for f in manifest["files"]][:2] == [
        ("train", "europarl-v7", "en"), ("train", "europarl-v7", "de")]
    first = manifest["files"][0]
    assert first["url"] == f"{base}/wmt13/training-parallel-europarl-v7.tgz"
    assert (first["member"], first["lines"]) == ("training/europarl-v7.de-en.en", 8)
    assert manifest["outputs"]["train.en"]["lines"] == 16
    metrics = json.loads((tmp_path / "metrics" / "download.details.json").read_text())
    assert metrics["pairs"] == {"train": 16, "valid": 4, "test": 3}
    assert {s for s, _, _ in faults.log} == {"/wmt13/training-parallel-europarl-v7.tgz",
                                             "/wmt13/training-parallel-commoncrawl.tgz",
                                             "/wmt14/training-parallel-nc-v9.tgz", "/wmt14/dev.tgz",
                                             "/wmt14/test-full.tgz"}
    assert len(faults.log) == 5  # one request per archive, each archive read once


def test_odd_line_separators_stay_aligned(statmt, tmp_path: Path) -> None:
    base, _, c, _ = statmt
    raw = _run(tmp_path, _spec(base))
    en, de = list(read_lines(raw / "train.en")), list(read_lines(raw / "train.de"))
    assert len(en) == len(de) == 16
    assert en[1:5] == [f"en: {s}" for s in ODD] and de[1:5] == [f"de: {s}" for s in ODD]


def test_cut_transfer_resumes_with_range(statmt, tmp_path: Path) -> None:
    base, faults, c, _ = statmt
    faults.drop_once.add("/wmt13/training-parallel-europarl-v7.tgz")
    raw = _run(tmp_path, _spec(base))
    hits = [(r, s) for p, r, s in faults.log if p == "/wmt13/training-parallel-europarl-v7.tgz"]
    assert hits[0] == (None, 200) and hits[1][0].startswith("bytes=") and hits[1][1] == 206
    assert int(hits[1][0][len("bytes="):-1]) > 0
    assert (raw / "train.en").read_bytes().startswith(_text(c["europarl"]["en"]))


def test_server_ignoring_range_restarts_cleanly(statmt, tmp_path: Path) -> None:
    base, faults, c, root = statmt
    faults.ignore_range = True
    faults.drop_once.add("/wmt14/dev.tgz")
    raw = _run(tmp_path, _spec(base))
    hits = [(r, s) for p, r, s in faults.log if p == "/wmt14/dev.tgz"]
    assert hits[1][0] is not None and hits[1][1] == 200
    assert (tmp_path / "cache/127.0.0.1_" f"{base.rsplit(':', 1)[1]}/wmt14/dev.tgz").read_bytes() == (
        root / "wmt14/dev.tgz").read_bytes()
    assert (raw / "valid.de").read_bytes() == _text(c["newstest2013"]["de"])


def test_server_error_once_is_retried(statmt, tmp_path: Path) -> None:
    base, faults, c, _ = statmt
    faults.status_once["/wmt14/test-full.tgz"] = 500
    faults.status_once["/wmt14/dev.tgz"] = 503
    _run(tmp_path, _spec(base))
    assert [s for p, _, s in faults.log if p == "/wmt14/test-full.tgz"] == [500, 200]


def test_persistent_server_errors_give_up_with_mirror_hint(statmt, tmp_path: Path) -> None:
    base, faults, _, _ = statmt
    faults.status_once["/wmt14/dev.tgz"] = 500
    with pytest.raises(DownloadError, match=r"dev.tgz: could not download after 1 attempt.*NMT_DATA_MIRROR"):
        _run(tmp_path, _spec(base), retries=0)
    assert not (tmp_path / "raw").exists()


def test_unreachable_host_suggests_mirror(tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match=r"127.0.0.1:9/wmt13/training-parallel-europarl-v7.tgz: could not "
                                            r"download after 2 attempt.*set NMT_DATA_MIRROR.*wmt14/training/"):
        _run(tmp_path, _spec("http://127.0.0.1:9"), retries=1)
    assert not (tmp_path / "raw").exists()


def test_404_names_the_url(statmt, tmp_path: Path) -> None:
    base, _, _, root = statmt
    (root / "wmt14/training-parallel-nc-v9.tgz").unlink()
    with pytest.raises(DownloadError, match=rf"{base}/wmt14/training-parallel-nc-v9.tgz: HTTP 404"):
        _run(tmp_path, _spec(base))
    assert not (tmp_path / "raw").exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_archive_is_rejected_and_raw_kept(statmt, tmp_path: Path, monkeypatch, damage: str) -> None:
    base, _, _, root = statmt
    before = _outputs(_run(tmp_path, _spec(base)))
    monkeypatch.setenv("NMT_DOWNLOAD_CACHE", str(tmp_path / "cache2"))
    archive = root / "wmt14/training-parallel-nc-v9.tgz"
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) * 2 // 3] if damage == "truncated" else b"not a tarball" * 10)
    with pytest.raises(DownloadError, match=r"cache2/.*training-parallel-nc-v9.tgz: corrupt or truncated "
                                            r"archive .*the cached copy was deleted: run the stage again"):
        _run(tmp_path, _spec(base))
    assert _outputs(tmp_path / "raw") == before
    assert not list((tmp_path / "cache2").rglob("training-parallel-nc-v9.tgz*"))  # a rerun (or a retry) refetches it
    assert len(list((tmp_path / "cache2").rglob("*.tgz"))) == 4  # the good ones stay cached
    archive.write_bytes(data)
    assert _outputs(_run(tmp_path, _spec(base))) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".raw")) == []


def _link(name: str, target: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize("bad", [
    tarfile.TarInfo("../evil.txt"), tarfile.TarInfo("/etc/evil"), tarfile.TarInfo("dev/../../evil"),
    _link("dev/link", "../../outside", tarfile.SYMTYPE), _link("dev/abs", "/etc/passwd", tarfile.SYMTYPE),
    _link("dev/hard", "../x", tarfile.LNKTYPE),
], ids=["dotdot", "absolute", "nested-dotdot", "symlink-out", "symlink-abs", "hardlink-out"])
def test_tar_member_escaping_is_refused(tmp_path: Path, bad: tarfile.TarInfo) -> None:
    root = tmp_path / "statmt"
    _statmt_tree(root)
    members = {f"dev/newstest2013.{lg}": _text(_corpus_lines("newstest2013", lg, 4)) for lg in ("en", "de")}
    _tgz(root / "wmt14/dev.tgz", members, extra=[bad])
    with serve(root) as (base, _):
        with pytest.raises(DownloadError, match=r"dev.tgz: (member|link) .* points outside .*refusing"):
            _run(tmp_path, _spec(base))
    assert not (tmp_path / "raw").exists()
    assert not (tmp_path / "evil.txt").exists()


def test_en_de_line_count_mismatch(statmt, tmp_path: Path) -> None:
    base, _, c, root = statmt
    _tgz(root / "wmt14/dev.tgz", {"dev/newstest2013.en": _text(c["newstest2013"]["en"]),
                                  "dev/newstest2013.de": _text(c["newstest2013"]["de"][:-1])})
    with pytest.raises(DownloadError, match=r"dev.tgz:dev/newstest2013.en has 4 lines but "
                                            r"dev.tgz:dev/newstest2013.de has 3"):
        _run(tmp_path, _spec(base, newstest2013=None))
    assert not (tmp_path / "raw").exists()


def test_invalid_utf8_names_the_member_and_line(statmt, tmp_path: Path) -> None:
    base, _, c, root = statmt
    bad = _text(c["newstest2013"]["de"][:2]) + b"caf\xe9\n" + _text(c["newstest2013"]["de"][3:])
    _tgz(root / "wmt14/dev.tgz", {"dev/newstest2013.en": _text(c["newstest2013"]["en"]), "dev/newstest2013.de": bad})
    with pytest.raises(DataError, match=r"dev.tgz:dev/newstest2013.de: .*newstest2013.de\):3: invalid UTF-8") as err:
        _run(tmp_path, _spec(base))
    assert not (tmp_path / "raw").exists()
    # The file a user can open (the archive in the mirror or cache), never the deleted extraction folder.
    assert "extract-" not in str(err.value) and "dev.tgz (member dev/newstest2013.de):3: invalid UTF-8" in str(err.value)


def test_unreadable_previous_manifest_is_named(statmt, tmp_path: Path) -> None:
    base, _, _, _ = statmt
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw/manifest.json").write_text("{not json")
    with pytest.raises(DownloadError, match=r"raw/manifest.json: unreadable previous manifest .*delete it"):
        _run(tmp_path, _spec(base))
    assert (tmp_path / "raw/manifest.json").read_text() == "{not json"


def test_expected_line_count_enforced(statmt, tmp_path: Path) -> None:
    base, _, _, _ = statmt
    with pytest.raises(DownloadError, match=r"corpus commoncrawl: .* have 5 lines, expected 6"):
        _run(tmp_path, _spec(base, commoncrawl=6))
    assert not (tmp_path / "raw").exists()


def test_sha256_pin_from_params(statmt, tmp_path: Path) -> None:
    base, _, _, root = statmt
    good = _run(tmp_path / "a", _spec(base))
    files = json.loads((good / "manifest.json").read_text())["files"]
    pins = {f["member"].rsplit("/", 1)[-1]: f["sha256"] for f in files}
    assert _outputs(_run(tmp_path / "b", _spec(base), sha256=pins)) == _outputs(good)
    wrong = "0" * 64
    with pytest.raises(DownloadError, match=rf"newstest2013.de: sha256 mismatch: got {pins['newstest2013.de']}, "
                                            rf"params download.sha256.newstest2013.de expects {wrong}"):
        _run(tmp_path / "c", _spec(base), sha256={"newstest2013.de": wrong})
    with pytest.raises(DownloadError, match=r"dev.tgz: sha256 mismatch"):
        _run(tmp_path / "c", _spec(base), sha256={"dev.tgz": wrong})
    with pytest.raises(ConfigError, match=r"download.sha256.nope.txt: no file of dataset wmt14"):
        _run(tmp_path / "c", _spec(base), sha256={"nope.txt": wrong})
    assert not (tmp_path / "c" / "raw").exists()


def test_sha256_pinned_by_previous_manifest(statmt, tmp_path: Path, monkeypatch) -> None:
    base, _, c, root = statmt
    before = _outputs(_run(tmp_path, _spec(base)))
    monkeypatch.setenv("NMT_DOWNLOAD_CACHE", str(tmp_path / "cache2"))
    changed = [s.upper() for s in c["newstest2013"]["en"]]
    _tgz(root / "wmt14/dev.tgz", {"dev/newstest2013.en": _text(changed),
                                  "dev/newstest2013.de": _text(c["newstest2013"]["de"])})
    with pytest.raises(DownloadError, match=r"dev/newstest2013.en: sha256 mismatch: got [0-9a-f]{64}, the previous "
                                            r"run's .*manifest.json expects [0-9a-f]{64}.*delete .*manifest.json"):
        _run(tmp_path, _spec(base))
    assert _outputs(tmp_path / "raw") == before


def _mirror_tree(statmt_root: Path, mirror: Path) -> None:
    """A mirror: some members extracted (tried first), the rest as archives under ``wmt14/``."""
    for name in ("training-parallel-europarl-v7.tgz", "training-parallel-commoncrawl.tgz"):
        (mirror / "wmt14").mkdir(parents=True, exist_ok=True)
        (mirror / "wmt14" / name).write_bytes((statmt_root / "wmt13" / name).read_bytes())
    (mirror / "wmt14/training-parallel-nc-v9.tgz").write_bytes(
        (statmt_root / "wmt14/training-parallel-nc-v9.tgz").read_bytes())
    for name in ("dev.tgz", "test-full.tgz"):
        with tarfile.open(statmt_root / "wmt14" / name) as tar:
            tar.extractall(mirror / "wmt14", filter="data")


def test_mirror_dir_and_http_give_identical_bytes(statmt, tmp_path: Path, monkeypatch) -> None:
    base, faults, _, root = statmt
    via_http = _outputs(_run(tmp_path / "http", _spec(base)))
    mirror = tmp_path / "mirror"
    _mirror_tree(root, mirror)
    assert (mirror / "wmt14/dev/newstest2013.en").is_file()
    n_requests = len(faults.log)
    monkeypatch.setenv("NMT_DATA_MIRROR", str(mirror))
    monkeypatch.setenv("NMT_DOWNLOAD_CACHE", str(tmp_path / "cache-mirror"))
    assert _outputs(_run(tmp_path / "dir", _spec(base))) == via_http
    assert len(faults.log) == n_requests  # no network
    origins = json.loads((tmp_path / "dir/metrics/download.details.json").read_text())["origins"]
    assert set(origins.values()) == {"mirror"}
    # the same mirror over HTTP (extracted members found there first, archives otherwise)
    with serve(mirror) as (mirror_url, mirror_faults):
        monkeypatch.setenv("NMT_DATA_MIRROR", mirror_url)
        assert _outputs(_run(tmp_path / "httpmirror", _spec(base))) == via_http
    assert len(faults.log) == n_requests
    assert ("/wmt14/dev/newstest2013.en", None, 200) in mirror_faults.log
    assert ("/wmt14/training/europarl-v7.de-en.en", None, 404) in mirror_faults.log


def test_mirror_without_network_for_missing_file_fails_clearly(tmp_path: Path, monkeypatch) -> None:
    mirror = tmp_path / "mirror"
    (mirror / "wmt14").mkdir(parents=True)
    monkeypatch.setenv("NMT_DATA_MIRROR", str(mirror))
    with pytest.raises(DownloadError, match=rf"^NMT_DATA_MIRROR={mirror}: holds neither "
                                            r"wmt14/training/europarl-v7.de-en.en nor "
                                            r"wmt14/training-parallel-europarl-v7.tgz; add one of them"):
        _run(tmp_path, _spec("http://127.0.0.1:9"), retries=0)
    monkeypatch.setenv("NMT_DATA_MIRROR", str(tmp_path / "absent"))
    with pytest.raises(DownloadError, match=r"NMT_DATA_MIRROR=.*absent.* neither a directory"):
        _run(tmp_path, _spec("http://127.0.0.1:9"))


def test_a_file_missing_from_an_http_mirror_is_an_error_not_a_download(statmt, tmp_path: Path,
                                                                       monkeypatch) -> None:
    """A mirror answering 404 for both the extracted file and the archive fails naming both; upstream is not asked."""
    base, faults, _, root = statmt
    mirror = tmp_path / "mirror"
    _mirror_tree(root, mirror)
    (mirror / "wmt14/training-parallel-nc-v9.tgz").unlink()
    n_requests = len(faults.log)
    with serve(mirror) as (mirror_url, mirror_faults):
        monkeypatch.setenv("NMT_DATA_MIRROR", mirror_url)
        with pytest.raises(DownloadError) as info:
            _run(tmp_path, _spec(base))
    assert str(info.value) == (f"NMT_DATA_MIRROR={mirror_url}: holds neither "
                               "wmt14/training/news-commentary-v9.de-en.en nor wmt14/training-parallel-nc-v9.tgz; "
                               "add one of them to the mirror, or set NMT_DATA_MIRROR empty to download "
                               f"{base}/wmt14/training-parallel-nc-v9.tgz")
    assert ("/wmt14/training-parallel-nc-v9.tgz", None, 404) in mirror_faults.log
    assert len(faults.log) == n_requests  # upstream never asked
    assert not (tmp_path / "raw").exists()


@pytest.mark.parametrize(("url", "problem"), [
    ("http://[::1", "Invalid IPv6 URL"),
    ("https://user:password@[::1/data", "Invalid IPv6 URL"),
    ("http://host:99999/data", "Port out of range 0-65535"),
    ("http:///data", "it has no host"),
])
def test_a_malformed_mirror_url_is_one_line_naming_the_variable(tmp_path: Path, monkeypatch, url: str,
                                                                problem: str) -> None:
    monkeypatch.setenv("NMT_DATA_MIRROR", url)
    with pytest.raises(DownloadError) as info:
        _run(tmp_path, _spec("http://127.0.0.1:9"))
    message = str(info.value)
    assert message.startswith("NMT_DATA_MIRROR=") and f"is not a valid URL ({problem}); set it to a folder" in message
    assert "password" not in message and "\n" not in message


def test_a_host_name_that_does_not_resolve_fails_at_once(tmp_path: Path, monkeypatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """No retries for a DNS failure (``.invalid`` never resolves), upstream or mirror."""
    with pytest.raises(DownloadError, match=r"http://nohost.invalid/wmt13/training-parallel-europarl-v7.tgz: host "
                                            r"'nohost.invalid' not found \(DNS lookup failed\).*set NMT_DATA_MIRROR"):
        _run(tmp_path, _spec("http://nohost.invalid"), retries=5)
    monkeypatch.setenv("NMT_DATA_MIRROR", "http://nohost.invalid/data")
    with pytest.raises(DownloadError, match=r"http://nohost.invalid/data/wmt14/training/europarl-v7.de-en.en: host "
                                            r"'nohost.invalid' not found .*; check NMT_DATA_MIRROR, or set it empty"):
        _run(tmp_path, _spec("http://127.0.0.1:9"), retries=5)
    assert "retrying" not in caplog.text


def test_corrupt_gzip_source_is_rejected(tmp_path: Path, monkeypatch) -> None:
    mirror = tmp_path / "mirror" / "multi30k" / "data/task1/raw"
    mirror.mkdir(parents=True)
    for stem, n in (("train", 3), ("val", 2), ("test_2016_flickr", 2)):
        for lang in ("en", "de"):
            lines = [f"{stem} {lang} {i}" for i in range(n)]
            (mirror / f"{stem}.{lang}.gz").write_bytes(gzip.compress(_text(lines), mtime=0))
    unchecked = {s: tuple(dataclasses.replace(c, lines=None) for c in MULTI30K_SPEC.split(s))
                 for s in ("train", "valid", "test")}
    spec = dataclasses.replace(MULTI30K_SPEC, **unchecked)
    monkeypatch.setenv("NMT_DATA_MIRROR", str(tmp_path / "mirror"))
    cfg = DownloadConfig(dataset="multi30k")
    stage(cfg, raw_dir=tmp_path / "raw", sources=spec)
    assert list(read_lines(tmp_path / "raw/valid.de")) == ["val de 0", "val de 1"]
    data = (mirror / "val.de.gz").read_bytes()
    (mirror / "val.de.gz").write_bytes(data[:-12])
    with pytest.raises(DownloadError, match=r"val.de.gz: corrupt or truncated archive .*replace the mirror's copy "
                                            r".*val.de.gz"):
        stage(cfg, raw_dir=tmp_path / "raw2", sources=spec)
    assert not (tmp_path / "raw2").exists()


@pytest.mark.skipif(not (SHARED / "wmt14/test-full").is_dir(), reason="needs the shared data folder")
def test_sgml_parser_matches_sacrebleu_text_of_newstest2014() -> None:
    for sgm, txt in (("newstest2014-deen-src.en.sgm", "newstest2014.en"),
                     ("newstest2014-deen-ref.de.sgm", "newstest2014.de")):
        got = list(sgml_segments(read_lines(SHARED / "wmt14/test-full" / sgm)))
        assert len(got) == 3003
        assert got == list(read_lines(SHARED / "wmt14/test-full-txt" / txt))


@pytest.mark.skipif(not (SHARED / "wmt14/dev").is_dir(), reason="needs the shared data folder")
def test_wmt14_valid_and_test_from_the_shared_mirror(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("NMT_DATA_MIRROR", str(SHARED))
    stand_in = Corpus(name="newstest2012", lines=3003,
                      en=SourceFile(url=f"{STATMT}/wmt14/dev.tgz", path="dev/newstest2012.en", archive=True),
                      de=SourceFile(url=f"{STATMT}/wmt14/dev.tgz", path="dev/newstest2012.de", archive=True))
    raw = _run(tmp_path, dataclasses.replace(WMT14, train=(stand_in,)))
    assert (raw / "valid.en").read_bytes() == (SHARED / "wmt14/dev/newstest2013.en").read_bytes()
    assert (raw / "test.en").read_bytes() == (SHARED / "wmt14/test-full-txt/newstest2014.en").read_bytes()
    assert (raw / "test.de").read_bytes() == (SHARED / "wmt14/test-full-txt/newstest2014.de").read_bytes()


@pytest.mark.skipif(not (SHARED / "multi30k").is_dir(), reason="needs the shared data folder")
def test_cli_multi30k_from_the_shared_mirror(tmp_path: Path, monkeypatch, capsys) -> None:
    params = (REPO / "profiles" / "paper.yaml").read_text(encoding="utf-8")
    params = params.replace("dataset: wmt14", "dataset: multi30k").replace("raw: data/wmt14/raw", "raw: data/raw") \
        .replace("metrics: metrics/paper", "metrics: metrics/x")
    (tmp_path / "params.yaml").write_text(params, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NMT_DATA_MIRROR", str(SHARED))
    assert main(["--params", "params.yaml"]) == 0
    manifest = json.loads((tmp_path / "data/raw/manifest.json").read_text())
    assert manifest["outputs"]["train.en"]["lines"] == 29000
    assert manifest["files"][0]["sha256"] == "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f"
    assert json.loads((tmp_path / "metrics/x/download.details.json").read_text())["pairs"] == {
        "train": 29000, "valid": 1014, "test": 1000}
    assert not (tmp_path / "metrics/x/download.json").exists()  # not a stage whose numbers DVC compares
    monkeypatch.setenv("NMT_DATA_MIRROR", str(tmp_path / "absent"))
    assert main(["--params", "params.yaml"]) == EXIT_PERMANENT
    assert "error: stage download: NMT_DATA_MIRROR=" in capsys.readouterr().err
