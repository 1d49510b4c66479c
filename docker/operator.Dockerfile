# The Governor operator: kopf + the SLO controller. No torch: the operator never imports it.
# Build from the repository root: docker build -f docker/operator.Dockerfile -t governor-operator .
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# The wheel is built from all three source roots (one distribution); only the operator extra is installed.
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY operator ./operator
RUN pip install ".[operator]" && rm -rf /src

RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin governor
USER 10001:10001
WORKDIR /

# kopf's liveness endpoint (--liveness=http://0.0.0.0:8080/healthz).
EXPOSE 8080
ENTRYPOINT ["governor", "operator"]
