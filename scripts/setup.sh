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
