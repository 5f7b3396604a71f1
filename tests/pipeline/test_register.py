"""Stage ``register`` against a real MLflow SQLite store: pyfunc logged once, registered, alias moved on valid BLEU.

The model is a random tiny ``averaged.pt`` built by the average stage; the evaluate outputs
(hypotheses, ``evaluate.details.json``) are written by hand so each test controls which model is better.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from pipeline.core.config import EvaluateConfig
from pipeline.core.details import RegisterDetails
from pipeline.core.errors import DataError, PipelineError
from pipeline.register import main, stage
from pipeline.tracking.harness import run_stage
from pipeline.tracking.model_registry import ModelVersion
from pipeline.tracking.promotion import decide, dvc_datasets, paired_bootstrap
from tests.helpers.lockholder import hold_lock
from tests.helpers.models import make_averaged

DEFAULT_MODEL_NAME = "wmt14-transformer"  # the paper profile's, without NMT_MODEL_NAME (docs/configuration.md)
WORDS = "der Hund sieht die Katze auf dem grünen Rasen vor dem alten Haus am Fluss".split()
REFS = [" ".join(WORDS[i % 5:i % 5 + 6 + i % 4]) + f" Nummer {i} ." for i in range(40)]
GOOD = [" ".join(r.split()[:-2]) + " ." for r in REFS]                  # drops one token per line
BAD = [" ".join(r.split()[1:-3]) for r in REFS]                         # loses much more
LOCK = {"stages": {"download": {"cmd": "python -m pipeline.download",
                                "outs": [{"path": "data/x/raw", "hash": "md5", "md5": "a" * 32 + ".dir",
                                          "size": 10, "nfiles": 6}]},
                   "encode": {"cmd": "python -m pipeline.encode",
                              "outs": [{"path": "data/x/shards", "hash": "md5", "md5": "b" * 32 + ".dir"}]}}}
DATASETS = {"raw": ("data/x/raw", "source"), "shards": ("data/x/shards", "training"),
            "bpe": ("data/x/bpe", "training")}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_averaged(tmp_path_factory.mktemp("register-model"), seed=5).parent


def _write_eval(root: Path, *, valid_bleu: float, test_hyps: list[str], alpha: float = 0.8) -> dict[str, Path]:
    """Evaluate's outputs as the register stage reads them (refs in raw/, hyps in eval/, evaluate.details.json)."""
    for sub in ("raw", "eval", "metrics"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for split in ("valid", "test"):
        (root / "raw" / f"{split}.de").write_text("\n".join(REFS) + "\n", encoding="utf-8")
    (root / "eval" / "valid.hyp.de").write_text("\n".join(GOOD) + "\n", encoding="utf-8")
    (root / "eval" / "test.hyp.de").write_text("\n".join(test_hyps) + "\n", encoding="utf-8")
    report = {"valid": {"bleu": valid_bleu}, "test": {"bleu": valid_bleu - 1, "signatures": {"bleu": "nrefs:1|x"}},
              "chosen": {"beam": 2, "alpha": alpha}, "mlflow_run_id": None}
    (root / "metrics" / "evaluate.details.json").write_text(json.dumps(report), encoding="utf-8")
    (root / "dvc.lock").write_text(yaml.safe_dump(LOCK), encoding="utf-8")
    return {"eval_dir": root / "eval", "raw_dir": root / "raw", "bleu_path": root / "metrics" / "evaluate.details.json",
            "lock_path": root / "dvc.lock"}


def _details(root: Path) -> Path:
    return root / "metrics" / "register.details.json"


def _register(model_dir: Path, root: Path, *, valid_bleu: float, test_hyps: list[str], alpha: float = 0.8) -> dict:
    """Run the stage; the same model with another chosen α stands in for another model."""
    paths = _write_eval(root, valid_bleu=valid_bleu, test_hyps=test_hyps, alpha=alpha)
    record = run_stage("register", lambda: stage(EvaluateConfig(max_len_b=10), model_dir=model_dir,
                                                 dataset_paths=DATASETS, root=root, **paths),
                       metrics_dir=root / "metrics", root=root)
    written = json.loads(_details(root).read_text(encoding="utf-8"))
    assert written == record.to_json() and not RegisterDetails.from_json(written, "register").extra
    return written


def _client():
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"], registry_uri=os.environ["MLFLOW_TRACKING_URI"])


@pytest.mark.slow
def test_a_registration_logs_an_input_example_and_no_warning_for_its_lack(model_dir: Path, tmp_path: Path,
                                                                          mlflow_sqlite: str,
                                                                          capfd: pytest.CaptureFixture[str],
                                                                          recwarn: pytest.WarningsRecorder) -> None:
    """MLflow warns (UserWarning) on every registration without an example; its own log handler says the rest."""
    import mlflow
    from mlflow.types import ColSpec, Schema

    from pipeline.tracking.promotion import INPUT_EXAMPLE

    record = _register(model_dir, tmp_path, valid_bleu=20.0, test_hyps=GOOD)
    said = [str(w.message) for w in recwarn] + capfd.readouterr().err.splitlines()
    assert not [m for m in said if "input example was not provided" in m], said
    assert not [m for m in said if "Failed to validate serving input example" in m], said
    assert any("Validating input example against model signature" in m for m in said)  # MLflow served it once
    uri = f"models:/{DEFAULT_MODEL_NAME}/{record['model_version']}"
    info = mlflow.models.get_model_info(uri)
    assert info.saved_input_example_info is not None
    assert info.signature.inputs == Schema([ColSpec("string")]) and info.signature.outputs == info.signature.inputs
    example = mlflow.models.Model.load(mlflow.artifacts.download_artifacts(uri)).load_input_example(
        mlflow.artifacts.download_artifacts(uri))
    assert list(example) == INPUT_EXAMPLE


@pytest.mark.slow
def test_first_model_takes_the_alias_worse_keeps_it_better_moves_it(model_dir: Path, tmp_path: Path,
                                                                     mlflow_sqlite: str) -> None:
    first = _register(model_dir, tmp_path / "a", valid_bleu=20.0, test_hyps=GOOD)
    assert first["alias_moved"] and first["model_version"] == "1" and first["candidate_version"] == "1"
    assert first["paired_bootstrap"] is None and first["previous_candidate"] is None
    client = _client()
    assert str(client.get_model_version_by_alias(DEFAULT_MODEL_NAME, "candidate").version) == "1"
    run = client.get_run(first["mlflow_run_id"])
    assert run.data.tags["stage"] == "register" and run.data.params["register.beam_size"] == "2"
    assert run.data.tags["dataset.raw.md5"] == "a" * 32 + ".dir"
    assert {d.dataset.name: d.dataset.digest for d in run.inputs.dataset_inputs} == {
        "raw": "a" * 32 + ".dir", "shards": "b" * 32 + ".dir"}  # bpe is not in this dvc.lock
    logged = {a.path for a in client.list_artifacts(first["mlflow_run_id"], "hyps")}
    assert logged == {"hyps/test.hyp.de", "hyps/valid.hyp.de"}
    version = client.get_model_version(DEFAULT_MODEL_NAME, "1")
    assert version.tags["run_id"] == first["mlflow_run_id"] and float(version.tags["valid_bleu"]) == 20.0
    assert version.tags["commit"]  # a git commit, or "none" outside a checkout
    model = client.get_registered_model(DEFAULT_MODEL_NAME)  # the model page: what it is, which profile and data
    assert model.tags == {"profile": "paper", "dataset": "wmt14"} and "profile paper, dataset wmt14" in model.description

    worse = _register(model_dir, tmp_path / "b", valid_bleu=19.5, test_hyps=BAD, alpha=0.6)
    assert not worse["alias_moved"] and worse["model_version"] == "2" and worse["candidate_version"] == "1"
    assert worse["decision"] == "valid BLEU 19.50 <= 20.00 of version 1"
    bs = worse["paired_bootstrap"]
    assert bs["candidate_bleu"] > bs["new_bleu"] and 0 < bs["p_value"] <= 0.05 and bs["n_samples"] == 1000
    assert "bs:1000" in bs["signature"] and not bs["identical_hypotheses"]
    metrics = client.get_run(worse["mlflow_run_id"]).data.metrics
    assert metrics["paired_bs_p_value"] == pytest.approx(bs["p_value"]) and metrics["alias_moved"] == 0
    assert str(client.get_model_version_by_alias(DEFAULT_MODEL_NAME, "candidate").version) == "1"

    better = _register(model_dir, tmp_path / "c", valid_bleu=21.0, test_hyps=GOOD, alpha=1.0)
    assert better["alias_moved"] and better["previous_candidate"]["version"] == "1"
    assert better["paired_bootstrap"]["p_value"] is not None
    assert str(client.get_model_version_by_alias(DEFAULT_MODEL_NAME, "candidate").version) == better["model_version"]

    again = _register(model_dir, tmp_path / "d", valid_bleu=21.0, test_hyps=GOOD, alpha=1.0)  # e.g. dvc repro -f
    assert again["model_version"] == better["model_version"] and again["mlflow_run_id"] == better["mlflow_run_id"]
    assert "is already version 3: not logged again" in again["decision"] and not again["alias_moved"]
    assert len(client.search_model_versions(f"name = '{DEFAULT_MODEL_NAME}'")) == 3


def _fresh_process(script: str, cwd: Path) -> dict:
    """Run ``script`` in a new interpreter without this checkout on the path; its last line, parsed as JSON."""
    proc = subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_candidate_loads_in_a_fresh_process_and_translates(model_dir: Path, tmp_path: Path,
                                                           mlflow_sqlite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NMT_MODEL_NAME", "tiny-translator")
    record = _register(model_dir, tmp_path, valid_bleu=5.0, test_hyps=GOOD)
    assert record["model_name"] == "tiny-translator" and record["alias_moved"]
    script = (
        "import json, sys, mlflow, pandas as pd\n"
        "m = mlflow.pyfunc.load_model('models:/tiny-translator@candidate')\n"
        "a = m.predict(['The dog sees the cat.', '', 'A house by the river.'])\n"
        "b = m.predict(pd.DataFrame({'src': ['The dog sees the cat.']}), params={'beam_size': 1, 'alpha': 0.0})\n"
        "refused = []\n"
        "for x, p in [([1, 2], {}), ([None], {}), ([{'a': 1}], {}), (['x'], {'beam_size': 65}),\n"
        "             (['x'], {'alpha': float('nan')})]:\n"
        "    try:\n"
        "        m.predict(x, params=p)\n"
        "        refused.append(None)\n"
        "    except mlflow.exceptions.MlflowException as exc:\n"
        "        refused.append([exc.error_code, exc.message])\n"
        "import pipeline\n"
        "print(json.dumps({'a': list(a), 'b': list(b), 'params': str(m.metadata.get_params_schema()),\n"
        "                  'code': pipeline.__file__, 'refused': refused}))\n"
    )
    out = _fresh_process(script, tmp_path)
    # the string input schema: MLflow refuses a number or a record in its own words before the model is reached
    assert [code for code, _ in out["refused"]] == ["INVALID_PARAMETER_VALUE"] * 5, out["refused"]
    assert [message.split(":")[0] for _, message in out["refused"][1:]] == [
        "inputs[0]", "Failed to enforce schema of data '[{'a'", "params.beam_size 65", "params.alpha NaN"
    ], out["refused"]
    assert "Incompatible input types for column 0." in out["refused"][0][1], out["refused"]
    assert "Incompatible input types for column a." in out["refused"][2][1], out["refused"]
    assert len(out["a"]) == 3 and out["a"][1] == "" and all(isinstance(s, str) for s in out["a"])
    assert out["a"][0] and len(out["b"]) == 1 and out["b"][0]
    assert Path(out["code"]).parts[-3:] == ("code", "pipeline", "__init__.py")  # the copy shipped with the model
    assert "beam_size': long (default: 2)" in out["params"] and "alpha': double (default: 0.8)" in out["params"]


@pytest.mark.slow
def test_the_translator_can_carry_a_ctranslate2_export(model_dir: Path, tmp_path: Path, mlflow_sqlite: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NMT_MODEL_NAME", "tiny-ct2")
    monkeypatch.setenv("NMT_REGISTER_CTRANSLATE2", "int8")
    assert _register(model_dir, tmp_path, valid_bleu=5.0, test_hyps=GOOD)["alias_moved"]
    script = (
        "import json, mlflow\n"
        "m = mlflow.pyfunc.load_model('models:/tiny-ct2@candidate')\n"
        "src = ['The dog sees the cat.', '', 'A house by the river.']\n"
        "out = {e: list(m.predict(src, params={'engine': e})) for e in ('ctranslate2', 'torch')}\n"
        "out['default'] = list(m.predict(src))\n"
        "try:\n"
        "    m.predict(src, params={'engine': 'onnx'})\n"
        "except Exception as exc:\n"
        "    out['error'] = str(exc)\n"
        "print(json.dumps(out))\n"
    )
    out = _fresh_process(script, tmp_path)
    assert out["default"] == out["ctranslate2"]  # the export decodes by default
    for engine in ("ctranslate2", "torch"):  # a tiny model may end a sentence at once (seen: int8 on an Intel CPU)
        assert len(out[engine]) == 3 and out[engine][1] == "" and (out[engine][0] or out[engine][2]), out
    assert "params.engine 'onnx': this model has torch, ctranslate2" in out["error"]
    version = _client().get_model_version_by_alias("tiny-ct2", "candidate")
    files = {Path(f).name for f in _artifact_files(version.source)}
    assert {"model.bin", "nmt_model.json", "spm.model", "nmt_sha256.json"} <= files  # the digest travels along


def _artifact_files(model_uri: str) -> list[str]:
    import mlflow

    local = Path(mlflow.artifacts.download_artifacts(model_uri))
    return [str(p) for p in local.rglob("*") if p.is_file()]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"mlflow models serve exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not ready within {seconds} s")


def _invoke(port: int, payload: dict) -> tuple[int, dict]:
    """POST ``payload`` to the served model's /invocations: (HTTP status, parsed answer)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _invoke_raw(port: int, body: bytes) -> tuple[int, bytes]:
    """POST the bytes ``body`` to /invocations: (HTTP status, the answer's bytes)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _guard_answers_400_in_bounded_words(port: int) -> None:
    """What MLflow's own server answered with 500 (a traceback in its log), ignored, or echoed whole."""
    for body, message in [
            (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
             "Error: the JSON is nested too deeply; send a list of strings"),
            (b'{"inputs": ["A man."], "params": {"beam_size": ' + b"9" * 5000 + b"}}",
             "Error: an integer of 5000 digits, more than the 30 any field takes (MAX_INT_DIGITS)"),
            (json.dumps({"inputs": ["A man."], "params": {"beam": 2}}).encode(),
             "Error: params: unknown 'beam'; this model reads beam_size, alpha, engine"),
            (json.dumps({"inputs": ["x" * 3_000_000]}).encode(),
             "Error: inputs[0]: 3000000 characters, more than the 10000 of one line (MAX_LINE_CHARS); split it into "
             "sentences")]:
        status, answer = _invoke_raw(port, body)
        assert status == 400 and len(answer) < 1200, (status, answer[:300])
        error = json.loads(answer)
        assert (error["error_code"], error["message"]) == ("INVALID_PARAMETER_VALUE", message)


def _tree_rss(pid: int) -> int:
    """Resident bytes of process ``pid`` and its descendants (the server and its workers)."""
    import psutil

    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


TWO_COLUMNS = ("inputs: a table of 2 columns ({}); send one column 'src' holding the source sentences, or a list "
               "of strings")


def _refuses_out_of_bounds_requests(port: int, server_pid: int) -> None:
    """A 10^6 beam (once 504 after 60 s at 14.8 GB), non-string inputs and a NaN alpha (once translated with 200):
    each refused with 400 naming the field, fast and without the server's memory growing."""
    before = _tree_rss(server_pid)
    for payload, field in [({"inputs": ["A man."], "params": {"beam_size": 1000000}}, "params.beam_size 1000000"),
                           ({"inputs": [1, 2]}, "inputs[0]: a value of type int"),
                           ({"inputs": [None]}, "inputs[0]: null is not a string"),
                           ({"inputs": [{"a": 1}]}, "inputs[0]"),
                           ({"inputs": ["A man."], "params": {"alpha": float("nan")}}, "params.alpha NaN"),
                           # a wider table: MLflow's input schema kept column 0 and answered 200 for it
                           ({"inputs": [["a b c", "x y z"], ["p", "q"]]}, TWO_COLUMNS.format("'0', '1'")),
                           ({"dataframe_records": [{"src": "A man.", "note": "x"}]},
                            TWO_COLUMNS.format("'src', 'note'")),
                           ({"dataframe_split": {"columns": ["src", "de"], "data": [["A man.", "Ein Mann."]]}},
                            TWO_COLUMNS.format("'src', 'de'"))]:
        start = time.monotonic()
        status, answer = _invoke(port, payload)
        assert time.monotonic() - start < 1.0 and status == 400, (payload, status, answer)
        assert answer["error_code"] == "INVALID_PARAMETER_VALUE" and f"Error: {field}" in answer["message"], answer
    assert _tree_rss(server_pid) - before < 100 * 2**20  # flat: nothing was decoded


@pytest.mark.slow
def test_served_candidate_answers_invocations(model_dir: Path, tmp_path: Path, mlflow_sqlite: str) -> None:
    _register(model_dir, tmp_path, valid_bleu=5.0, test_hyps=GOOD)
    port = _free_port()
    log_file = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--profile", "paper", "--port", str(port)],
                            cwd=tmp_path, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/ping", proc, 90)
        status, answer = _invoke(port, {"inputs": ["The dog sees the cat.", ""], "params": {"beam_size": 1}})
        assert status == 200 and len(answer["predictions"]) == 2
        assert answer["predictions"][0] and answer["predictions"][1] == ""
        _refuses_out_of_bounds_requests(port, proc.pid)
        _guard_answers_400_in_bounded_words(port)
        for one_column in ({"dataframe_split": {"columns": ["src"], "data": [["The dog sees the cat."], [""]]}},
                           {"inputs": {"src": ["The dog sees the cat.", ""]}}):
            assert _invoke(port, {**one_column, "params": {"beam_size": 1}}) == (status, answer)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
        log_file.close()


def test_tracking_off_writes_a_record_and_logs_nothing(model_dir: Path, tmp_path: Path) -> None:
    assert os.environ["NMT_TRACKING"] == "off"
    record = _register(model_dir, tmp_path, valid_bleu=5.0, test_hyps=GOOD)
    assert record["tracking"] == "off" and record["alias_moved"] is False and record["mlflow_run_id"] is None
    assert "NMT_TRACKING=off" in record["decision"]
    assert not (tmp_path / ".mlflow").exists() and not list(tmp_path.rglob("*.db"))


def test_cli_reads_paths_from_params(model_dir: Path, tmp_path: Path, repo_root: Path) -> None:
    from pipeline.project.profiles import merged_profile

    paths = _write_eval(tmp_path, valid_bleu=5.0, test_hyps=GOOD)
    params = merged_profile("tiny", repo_root)
    shutil.copytree(model_dir, tmp_path / "model")  # paths.* lie in the params file's folder
    params["paths"].update(model=str(tmp_path / "model"), eval=str(paths["eval_dir"]), raw=str(paths["raw_dir"]),
                           metrics=str(tmp_path / "metrics"))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    assert main(["--params", str(tmp_path / "params.yaml")]) == 0
    assert json.loads(_details(tmp_path).read_text(encoding="utf-8"))["tracking"] == "off"


@pytest.mark.parametrize("damage, message", [
    ("no_hyp", r"test\.hyp\.de: not found; run `dvc repro evaluate`"),
    ("short_hyp", r"test\.hyp\.de has 39 lines but .*test\.de has 40: the hypotheses are from another set"),
    ("bleu_key", r"evaluate\.details\.json: lacks chosen\.beam, chosen\.alpha .*rerun `dvc repro evaluate`"),
    ("no_model", r"averaged\.pt: not found; run `dvc repro average`"),
])
def test_bad_inputs_are_clear_errors_and_write_nothing(model_dir: Path, tmp_path: Path, damage: str,
                                                       message: str) -> None:
    paths = _write_eval(tmp_path, valid_bleu=5.0, test_hyps=GOOD)
    if damage == "no_hyp":
        (paths["eval_dir"] / "test.hyp.de").unlink()
    elif damage == "short_hyp":
        (paths["eval_dir"] / "test.hyp.de").write_text("\n".join(GOOD[:-1]) + "\n", encoding="utf-8")
    elif damage == "bleu_key":
        paths["bleu_path"].write_text(json.dumps({"valid": {"bleu": 1}, "test": {"bleu": 1}}), encoding="utf-8")
    elif damage == "no_model":
        model_dir = tmp_path / "empty"
    with pytest.raises(PipelineError, match=message):
        run_stage("register", lambda: stage(EvaluateConfig(), model_dir=model_dir, dataset_paths=DATASETS,
                                            root=tmp_path, **paths), metrics_dir=tmp_path / "metrics", root=tmp_path)
    assert not _details(tmp_path).exists() and not (tmp_path / "metrics" / "register.json").exists()


def test_a_model_file_changed_since_save_is_not_registered(model_dir: Path, tmp_path: Path,
                                                           mlflow_sqlite: str) -> None:
    from tests.helpers.corruption import flip_in_largest_record

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "averaged.pt").write_bytes((model_dir / "averaged.pt").read_bytes())
    flip_in_largest_record(corrupt / "averaged.pt")
    with pytest.raises(PipelineError, match=r"averaged\.pt: content does not match the sha256 recorded at save.*"
                                            r"`dvc repro average`"):
        _register(corrupt, tmp_path / "a", valid_bleu=20.0, test_hyps=GOOD)
    assert not _client().search_model_versions(f"name = '{DEFAULT_MODEL_NAME}'")


def test_a_registration_waits_its_turn_in_the_store_and_a_bounded_wait_writes_nothing(
        model_dir: Path, tmp_path: Path, mlflow_sqlite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep's variants register together into one store; two at once raced on the alias's row (SQLite
    IntegrityError) and could leave it on the worse model, so registrations take turns on a lock beside the store."""
    import pipeline.register as register_stage
    from pipeline.tracking import store_lock

    lock = store_lock(tmp_path)
    assert lock == Path(mlflow_sqlite.removeprefix("sqlite:///") + ".lock")
    holder = hold_lock(tmp_path, "register other", lock)
    monkeypatch.setattr(register_stage, "REGISTER_WAIT_S", 0.5)
    try:
        with pytest.raises(PipelineError, match=rf"^{re.escape(str(lock))}: another run holds it after waiting 0\.5 s "
                                                rf"\(pid {holder.pid}, since .*, register other\); wait for it to end"):
            _register(model_dir, tmp_path / "a", valid_bleu=20.0, test_hyps=GOOD)
        assert not _details(tmp_path / "a").exists()
        assert not _client().search_registered_models()
    finally:
        holder.communicate("", timeout=30)
    assert _register(model_dir, tmp_path / "a", valid_bleu=20.0, test_hyps=GOOD)["model_version"] == "1"


def test_dvc_datasets_come_from_lock_outs(tmp_path: Path) -> None:
    lock = tmp_path / "dvc.lock"
    lock.write_text(yaml.safe_dump(LOCK), encoding="utf-8")
    found = dvc_datasets(lock, {"raw": ("data/x/raw/", "source"), "bpe": ("data/x/bpe", "training")})
    assert [(d["name"], d["digest"], d["context"]) for d in found] == [("raw", "a" * 32 + ".dir", "source")]
    assert json.loads(found[0]["source"]) == {"path": "data/x/raw", "stage": "download", "md5": "a" * 32 + ".dir",
                                              "lock": "dvc.lock", "size": 10, "nfiles": 6}
    assert dvc_datasets(tmp_path / "missing.lock", {"raw": ("data/x/raw", "source")}) == []
    lock.write_text("stages: [unclosed\n", encoding="utf-8")
    expected = (r"dvc\.lock: not valid YAML \(expected ',' or '\]', but got '<stream end>' at line 2\); "
                r"restore it with `git checkout dvc\.lock`$")
    with pytest.raises(DataError, match=expected):
        dvc_datasets(lock, {})


def test_decide_uses_valid_bleu_only_and_refuses_other_references() -> None:
    refs = {"valid": "v", "test": "t"}
    holder = ModelVersion(version="3", run_id="r", tags={"valid_bleu": "20.0", "valid_ref_sha256": "v"})
    assert decide(20.5, refs, None) == (True, "no version held the alias before this one")
    assert decide(20.5, refs, holder)[0] and not decide(20.0, refs, holder)[0]
    moved, why = decide(30.0, {"valid": "other", "test": "t"}, holder)
    assert not moved and "not comparable" in why and "NMT_MODEL_NAME" in why
    moved, why = decide(30.0, refs, dataclasses.replace(holder, tags={"valid_ref_sha256": "v"}))
    assert not moved and "no valid_bleu tag" in why


def test_paired_bootstrap_is_deterministic_and_symmetric_in_its_verdict() -> None:
    one = paired_bootstrap(BAD, GOOD, REFS)
    assert one == paired_bootstrap(BAD, GOOD, REFS)
    other = paired_bootstrap(GOOD, BAD, REFS)
    assert one["new_bleu"] == other["candidate_bleu"] and one["p_value"] < 0.05 and other["p_value"] < 0.05
    with pytest.raises(DataError, match="paired bootstrap needs equal lengths: new 39"):
        paired_bootstrap(BAD[:-1], GOOD, REFS)
