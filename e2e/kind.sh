#!/usr/bin/env bash
# End-to-end on a real cluster (kind or any kubeconfig): install the CRD and the operator chart, apply the
# minimal InferenceService with a CPU engine image, wait for Ready, check its children, send a completion,
# roll out a new revision as a canary (promoted after one step), delete it and check that garbage
# collection removes them. Skips (exit 0) when no cluster answers, unless E2E_REQUIRED=1. Every wait is bounded.
# On exit it removes what it installed, and only that.
#
#   e2e/kind.sh [ENGINE_IMAGE]
#   e2e/kind.sh --split-image IMAGE    print IMAGE's "REPOSITORY TAG" (or "REPOSITORY DIGEST") and exit
#
# Environment: OPERATOR_IMAGE (repository[:tag] or repository@digest), MODEL_URI (a model the CPU engine can
# load), NAMESPACE (of the test service, default governor-e2e), OPERATOR_NAMESPACE (default governor-system),
# RELEASE (Helm release, default governor), READY_TIMEOUT (seconds, default 600), E2E_REQUIRED (1: a missing
# kubectl or cluster fails the run instead of skipping it).
set -euo pipefail
cd "$(dirname "$0")/.."

# An image reference as "REPOSITORY TAG" (no tag: latest), or "REPOSITORY DIGEST" when pinned by digest (a digest
# holds a colon, a tag never does). Only the last path component can carry a tag: localhost:5000/x is untagged.
split_image() {
  local ref=$1 repo last tag digest
  if [[ $ref == *@* ]]; then
    repo=${ref%%@*}
    digest=${ref#*@}
    last=${repo##*/}
    [[ $last == *:* ]] && repo=${repo%:*}  # repository:tag@digest runs the digest; the tag is only a label
    [[ $digest =~ ^[a-z0-9]+([+._-][a-z0-9]+)*:[0-9a-fA-F]{32,}$ ]] \
      || { echo "e2e/kind.sh: '$digest' in $ref is not a digest (algorithm:hex)" >&2; return 1; }
    tag=$digest
  else
    last=${ref##*/}
    if [[ $last == *:* ]]; then
      repo=${ref%:*}
      tag=${last##*:}
    else
      repo=$ref
      tag=latest
    fi
    [[ $tag =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || { echo "e2e/kind.sh: '$tag' in $ref is not a tag" >&2; return 1; }
  fi
  [ -n "$repo" ] || { echo "e2e/kind.sh: no repository in $ref" >&2; return 1; }
  printf '%s %s\n' "$repo" "$tag"
}

if [ "${1:-}" = --split-image ]; then
  split_image "${2:?usage: e2e/kind.sh --split-image IMAGE}"
  exit
fi

ENGINE_IMAGE=${1:-${ENGINE_IMAGE:-governor-engine:cpu}}
OPERATOR_IMAGE=${OPERATOR_IMAGE:-governor-operator:dev}
MODEL_URI=${MODEL_URI:-hf://Qwen/Qwen2.5-0.5B-Instruct}
NAMESPACE=${NAMESPACE:-governor-e2e}
OPERATOR_NAMESPACE=${OPERATOR_NAMESPACE:-governor-system}
RELEASE=${RELEASE:-governor}
READY_TIMEOUT=${READY_TIMEOUT:-600}
E2E_REQUIRED=${E2E_REQUIRED:-0}
NAME=chat
CRD=inferenceservices.governor.dev
OPERATOR_DEPLOYMENT=$RELEASE-operator  # the chart's fullname
PYTHON=${PYTHON:-python3}  # with PyYAML (.venv/bin/python has it)
PATH="$PATH:$PWD/.venv/bin"  # helm and kubectl from scripts/setup.sh, where none are installed already

log() { printf '[e2e] %s\n' "$*"; }
fail() { printf '[e2e] FAIL: %s\n' "$*" >&2; exit 1; }
skip() {
  [ "$E2E_REQUIRED" = 1 ] && fail "$* (E2E_REQUIRED=1: a cluster is required)"
  log "SKIP: $*"
  exit 0
}

if ! command -v kubectl >/dev/null; then
  skip "kubectl is not installed (bash scripts/setup.sh puts it in .venv/bin)"
fi
if ! timeout 20 kubectl cluster-info >/dev/null 2>&1; then
  skip "no Kubernetes cluster answers (kubectl cluster-info failed); create one with 'kind create cluster'"
fi
command -v helm >/dev/null || fail "helm is not installed (bash scripts/setup.sh puts it in .venv/bin)"
read -r image_repo image_ref < <(split_image "$OPERATOR_IMAGE") || fail "OPERATOR_IMAGE=$OPERATOR_IMAGE"
if [[ $image_ref == *:* ]]; then image_value=(--set "image.digest=$image_ref"); else image_value=(--set "image.tag=$image_ref"); fi

# Children of the service: objects of these kinds whose ownerReferences name the InferenceService.
owned() {
  kubectl -n "$NAMESPACE" get deployments,services,configmaps,secrets -o json \
    | "$PYTHON" -c 'import json, sys
for o in json.load(sys.stdin)["items"]:
    if any(r.get("kind") == "InferenceService" and r.get("name") == sys.argv[1]
           for r in o["metadata"].get("ownerReferences", [])):
        print(o["kind"] + "/" + o["metadata"]["name"])' "$NAME"
}

# What this run created, so that cleanup removes exactly that.
created_crd=0 created_operator_namespace=0 created_namespace=0 installed_release=0 applied_service=0 port_forward=""
cleanup() {
  set +e
  [ -n "$port_forward" ] && kill "$port_forward" 2>/dev/null
  # The service goes first, while the operator still runs: only the operator releases its finalizer.
  if [ "$created_namespace" = 1 ]; then
    kubectl delete namespace "$NAMESPACE" --ignore-not-found --timeout=180s >/dev/null \
      || log "cleanup: namespace $NAMESPACE is not gone after 180s"
  elif [ "$applied_service" = 1 ]; then
    kubectl -n "$NAMESPACE" delete "inferenceservice/$NAME" --ignore-not-found --timeout=120s >/dev/null \
      || log "cleanup: inferenceservice/$NAME is not gone after 120s"
  fi
  if [ "$installed_release" = 1 ]; then
    helm uninstall "$RELEASE" --namespace "$OPERATOR_NAMESPACE" --wait --timeout 120s >/dev/null \
      || log "cleanup: helm uninstall $RELEASE failed"
  fi
  if [ "$created_operator_namespace" = 1 ]; then
    kubectl delete namespace "$OPERATOR_NAMESPACE" --ignore-not-found --wait=false >/dev/null
  fi
  if [ "$created_crd" = 1 ]; then
    kubectl delete crd "$CRD" --ignore-not-found --wait=false >/dev/null
  fi
  return 0
}
trap cleanup EXIT

create_namespace() {  # prints 1 when it created the namespace, 0 when it was there already
  if kubectl get namespace "$1" >/dev/null 2>&1; then echo 0; else kubectl create namespace "$1" >/dev/null && echo 1; fi
}

log "CRD $CRD"
kubectl get crd "$CRD" >/dev/null 2>&1 || created_crd=1
# Server-side: the same field manager Helm and GitOps tools use for CRDs, and no last-applied annotation holding
# a copy of the whole CRD (which only grows as the API does; annotations are capped at 256 KiB).
kubectl apply --server-side --field-manager=governor-e2e -f crds/
kubectl wait --for=condition=Established "crd/$CRD" --timeout=60s

log "operator chart ($OPERATOR_IMAGE) as release $RELEASE in $OPERATOR_NAMESPACE"
if helm status "$RELEASE" --namespace "$OPERATOR_NAMESPACE" >/dev/null 2>&1; then
  fail "Helm release $RELEASE already exists in $OPERATOR_NAMESPACE: uninstall it or set RELEASE to another name"
fi
created_operator_namespace=$(create_namespace "$OPERATOR_NAMESPACE")
created_namespace=$(create_namespace "$NAMESPACE")
# kind has no Prometheus Operator: no PodMonitor. The e2e namespace is watched so the Role and the NetworkPolicy
# land there.
chart_args=(--namespace "$OPERATOR_NAMESPACE" --set "image.repository=$image_repo" "${image_value[@]}"
            --set image.pullPolicy=IfNotPresent --set podMonitor.enabled=false
            --set "watchedNamespaces={$NAMESPACE}")
installed_release=1
helm install "$RELEASE" charts/governor "${chart_args[@]}" --wait --timeout 180s
kubectl -n "$OPERATOR_NAMESPACE" rollout status "deployment/$OPERATOR_DEPLOYMENT" --timeout=180s

log "InferenceService $NAME (engine $ENGINE_IMAGE, model $MODEL_URI)"
applied_service=1
"$PYTHON" - "$ENGINE_IMAGE" "$MODEL_URI" <<'PY' | kubectl -n "$NAMESPACE" apply -f -
import sys, yaml
svc = yaml.safe_load(open("examples/inferenceservice-minimal.yaml"))
svc["spec"]["engine"]["image"] = sys.argv[1]
svc["spec"]["model"]["uri"] = sys.argv[2]
svc["spec"]["engine"]["resources"] = {"gpus": 0, "cpu": "2", "memory": "4Gi"}  # CPU engine
print(yaml.safe_dump(svc))
PY

if ! kubectl -n "$NAMESPACE" wait --for=condition=Ready "inferenceservice/$NAME" --timeout="${READY_TIMEOUT}s"; then
  kubectl -n "$NAMESPACE" get "inferenceservice/$NAME" -o yaml || true
  kubectl -n "$NAMESPACE" get pods -o wide || true
  kubectl -n "$OPERATOR_NAMESPACE" logs "deployment/$OPERATOR_DEPLOYMENT" --tail=100 || true
  fail "InferenceService $NAME not Ready within ${READY_TIMEOUT}s"
fi

children=$(owned)
log "children: $(echo "$children" | tr '\n' ' ')"
grep -q '^Deployment/' <<<"$children" || fail "no Deployment owned by $NAME"
grep -q '^Service/' <<<"$children" || fail "no Service owned by $NAME"

log "send a completion through the Service"
served=$(kubectl -n "$NAMESPACE" get "inferenceservice/$NAME" -o jsonpath='{.spec.model.servedName}')
served=${served:-$NAME}
kubectl -n "$NAMESPACE" port-forward "service/$NAME" 18000:8000 >/dev/null 2>&1 &
port_forward=$!
answer=""
for _ in $(seq 1 30); do
  answer=$(curl -sf --max-time 60 http://127.0.0.1:18000/v1/completions -H 'Content-Type: application/json' \
    -d "{\"model\": \"$served\", \"prompt\": \"Hello\", \"max_tokens\": 8}" || true)
  [ -n "$answer" ] && break
  sleep 2
done
kill "$port_forward" 2>/dev/null || true
port_forward=""
grep -q '"choices"' <<<"$answer" || fail "no completion from service/$NAME: $answer"
log "completion: $answer"

log "canary rollout: a static engine change is a new revision, walked through one short step and promoted"
stable=$(kubectl -n "$NAMESPACE" get "inferenceservice/$NAME" -o jsonpath='{.status.revision}')
kubectl -n "$NAMESPACE" patch "inferenceservice/$NAME" --type merge -p \
  '{"spec": {"engine": {"maxModelLen": 1024}, "rollout": {"steps": [{"weight": 50, "pause": "20s"}]}}}'
phase=""
for _ in $(seq 1 $((READY_TIMEOUT / 5))); do
  phase=$(kubectl -n "$NAMESPACE" get "inferenceservice/$NAME" -o jsonpath='{.status.rollout.phase}')
  [ "$phase" = Promoted ] || [ "$phase" = RolledBack ] || [ "$phase" = Aborted ] && break
  sleep 5
done
kubectl -n "$NAMESPACE" get "inferenceservice/$NAME" -o jsonpath='{.status.rollout}'; echo
[ "$phase" = Promoted ] || fail "rollout ended as '$phase', expected Promoted"
now=$(kubectl -n "$NAMESPACE" get "inferenceservice/$NAME" -o jsonpath='{.status.revision}')
[ "$now" != "$stable" ] || fail "status.revision is still $stable after the promotion"
deployments=$(kubectl -n "$NAMESPACE" get deployments -l "governor.dev/service=$NAME" -o name | wc -l)
[ "$deployments" -eq 1 ] || fail "$deployments Deployments after promotion, expected 1 (the old stable removed)"
log "promoted: $stable -> $now"

log "delete and garbage collection"
kubectl -n "$NAMESPACE" delete "inferenceservice/$NAME" --timeout=120s
for _ in $(seq 1 60); do
  [ -z "$(owned)" ] && { log "PASS"; exit 0; }
  sleep 2
done
fail "children left 120s after deleting $NAME: $(owned | tr '\n' ' ')"
