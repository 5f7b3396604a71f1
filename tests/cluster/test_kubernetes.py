"""The Kubernetes recipe (cluster/kubernetes/): Prefect's own ``prefect work-pool create --type kubernetes
--base-job-template`` accepts the GPU job template against a real server, prefect-kubernetes' worker (where
installed) renders it into a Job requesting ``nvidia.com/gpu``, and the indexed Job's names and node counts agree.
Nothing here runs on a Kubernetes cluster."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.paths import REPO

KUBE = REPO / "cluster" / "kubernetes"
TEMPLATE = KUBE / "gpu-job-template.json"
PREFECT = str(Path(sys.executable).with_name("prefect"))


@pytest.mark.slow
def test_prefect_accepts_the_gpu_template_as_a_kubernetes_work_pool(prefect_server: dict[str, str]) -> None:
    done = subprocess.run([PREFECT, "work-pool", "create", "k8s-gpu", "--type", "kubernetes", "--base-job-template",
                           str(TEMPLATE)], env=prefect_server, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}), \
            get_client(sync_client=True) as client:
        pool = client.read_work_pool("k8s-gpu")
    assert pool.type == "kubernetes" and pool.base_job_template == json.loads(TEMPLATE.read_text(encoding="utf-8"))


@pytest.mark.skipif(importlib.util.find_spec("prefect_kubernetes") is None, reason="prefect-kubernetes is not "
                    "installed (pip install prefect-kubernetes to check the template with its worker)")
@pytest.mark.usefixtures("prefect_harness")  # skipped before the harness starts (~15 s) where it cannot run
def test_the_kubernetes_worker_renders_a_job_requesting_the_gpus() -> None:
    from prefect_kubernetes import worker
    from prefect.utilities.asyncutils import run_coro_as_sync

    config = run_coro_as_sync(worker.KubernetesWorkerJobConfiguration.from_template_and_values(
        json.loads(TEMPLATE.read_text(encoding="utf-8")), {"image": "wmt14:test", "gpus": 4}))
    container = config.job_manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "wmt14:test"
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 4


def test_the_indexed_job_meets_at_pod_0_of_its_own_service_with_one_pod_per_node() -> None:
    service, job = yaml.safe_load_all((KUBE / "train-indexed-job.yaml").read_text(encoding="utf-8"))
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (service["kind"], job["kind"], spec["completionMode"]) == ("Service", "Job", "Indexed")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert pod["subdomain"] == service["metadata"]["name"]
    host, port = env["NMT_RDZV_ENDPOINT"].split(":")
    assert host == f"{job['metadata']['name']}-0.{pod['subdomain']}"  # an Indexed Job's pod 0
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    assert spec["completions"] == spec["parallelism"] == int(env["NMT_NNODES"])
    assert int(env["NMT_NPROC"]) == container["resources"]["limits"]["nvidia.com/gpu"]
    assert container["command"] == ["python", "-m", "pipeline.launch"]
    train = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))["stages"]["train"]
    assert " ".join(container["command"]) == train["cmd"]  # the train stage's own command
