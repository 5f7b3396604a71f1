# The environment a cluster node runs the pipeline in (a Prefect Kubernetes worker's flow runs, the indexed Job in
# cluster/kubernetes/): Python, torch and the stack at the versions constraints.txt pins. The code is not in the
# image: a flow run clones the deployed commit (prefect.yaml's pull steps), a Job mounts the shared checkout.
#   docker build -t wmt14-transformer:$(git rev-parse --short HEAD) .
# Not built here: this machine has no Docker daemon and no registry to pull the base image from (docs/cluster.md).
ARG PYTHON_VERSION=3.11.7
FROM python:${PYTHON_VERSION}-slim-bookworm

# git: Prefect's git_clone pull step and DVC; tini: signals reach the flow's process group (docs/cluster.md).
RUN apt-get update && apt-get install -y --no-install-recommends git tini && rm -rf /var/lib/apt/lists/*

# torch first with an exact pin, as the Makefile does (PyPI's Linux wheel of 2.13.0 is the CUDA build), then the
# stack with the same pins as `make install`; the project itself is uninstalled again: only its dependencies stay.
ARG TORCH_VERSION=2.13.0
WORKDIR /tmp/build
COPY pyproject.toml constraints.txt README.md ./
COPY model model
COPY pipeline pipeline
COPY flows flows
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir -c constraints.txt . \
    && pip uninstall -y wmt14-transformer \
    && cd / && rm -rf /tmp/build

# No telemetry from any tool (docs/cluster.md, Telemetry).
ENV DO_NOT_TRACK=true PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true DVC_NO_ANALYTICS=1 \
    PYTHONUNBUFFERED=1
RUN git config --system --add safe.directory '*' && dvc config --system core.check_update false
WORKDIR /work
ENTRYPOINT ["/usr/bin/tini", "--"]
