# The Governor engine: `governor serve MODEL_DIR` on a GPU.
# Build from the repository root:
#   docker build -f docker/engine.Dockerfile -t governor-engine .
# CPU image (kind, e2e):
#   docker build -f docker/engine.Dockerfile --build-arg BASE=ubuntu:24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu -t governor-engine:cpu .
ARG BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH

# Ubuntu 24.04's Python is 3.12; a venv keeps pip away from the system packages (PEP 668).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch first, from the index matching the base (CUDA 12.8 or CPU), so the engine extra does not pull another build.
RUN pip install "torch>=2.11" --index-url "${TORCH_INDEX}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY operator ./operator
# huggingface_hub fetches hf:// models into the pod's model volume.
RUN pip install ".[engine]" huggingface_hub && rm -rf /src

RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin governor
USER 10001:10001
WORKDIR /home/governor
ENV HF_HOME=/home/governor/.cache/huggingface

# OpenAI API, /health, /ready, /metrics and /admin/knobs.
EXPOSE 8000
ENTRYPOINT ["governor", "serve"]
