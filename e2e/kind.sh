#!/usr/bin/env bash
# End-to-end on a real cluster (kind or any kubeconfig): install the CRD and the operator chart, apply the
# minimal InferenceService with a CPU engine image, wait for Ready, check its children, send a completion,
# roll out a new revision as a canary (promoted after one step), delete it and check that garbage
# collection removes them. Skips (exit 0) when no cluster answers. Every wait is bounded.
#
#   e2e/kind.sh [ENGINE_IMAGE]
#
# Environment: OPERATOR_IMAGE (repository:tag of the operator), MODEL_URI (a model the CPU engine can load),
# NAMESPACE (of the test service, default governor-e2e), READY_TIMEOUT (seconds, default 600).
set -euo pipefail
cd "$(dirname "$0")/.."

ENGINE_IMAGE=${1:-${ENGINE_IMAGE:-governor-engine:cpu}}
OPERATOR_IMAGE=${OPERATOR_IMAGE:-governor-operator:dev}
MODEL_URI=${MODEL_URI:-hf://Qwen/Qwen2.5-0.5B-Instruct}
NAMESPACE=${NAMESPACE:-governor-e2e}
OPERATOR_NAMESPACE=${OPERATOR_NAMESPACE:-governor-system}
READY_TIMEOUT=${READY_TIMEOUT:-600}
NAME=chat
PYTHON=${PYTHON:-python3}  # with PyYAML (.venv/bin/python has it)

log() { printf '[e2e] %s\n' "$*"; }
fail() { printf '[e2e] FAIL: %s\n' "$*" >&2; exit 1; }

if ! command -v kubectl >/dev/null; then
  log "SKIP: kubectl is not installed"; exit 0
fi
if ! timeout 20 kubectl cluster-info >/dev/null 2>&1; then
  log "SKIP: no Kubernetes cluster answers (kubectl cluster-info failed); create one with 'kind create cluster'"
  exit 0
fi

# Children of the service: objects of these kinds whose ownerReferences name the InferenceService.
owned() {
  kubectl -n "$NAMESPACE" get deployments,services,configmaps,secrets -o json \
    | "$PYTHON" -c 'import json, sys
for o in json.load(sys.stdin)["items"]:
    if any(r.get("kind") == "InferenceService" and r.get("name") == sys.argv[1]
           for r in o["metadata"].get("ownerReferences", [])):
        print(o["kind"] + "/" + o["metadata"]["name"])' "$NAME"
}

cleanup() {
  kubectl delete namespace "$NAMESPACE" --ignore-not-found --wait=false >/dev/null 2>&1 || true
}
trap cleanup EXIT

log "CRD"
kubectl apply -f crds/
kubectl wait --for=condition=Established crd/inferenceservices.governor.dev --timeout=60s

log "operator chart ($OPERATOR_IMAGE) in $OPERATOR_NAMESPACE"
kubectl create namespace "$OPERATOR_NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -
repo=${OPERATOR_IMAGE%:*}
tag=${OPERATOR_IMAGE##*:}
# kind has no Prometheus Operator: no PodMonitor. The e2e namespace is watched so the NetworkPolicy lands there.
chart_args=(--namespace "$OPERATOR_NAMESPACE" --set "image.repository=$repo" --set "image.tag=$tag"
            --set image.pullPolicy=IfNotPresent --set podMonitor.enabled=false
            --set "watchedNamespaces={$NAMESPACE}")
kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -
if command -v helm >/dev/null; then
  helm upgrade --install governor charts/governor "${chart_args[@]}" --wait --timeout 180s
else
  fail "helm is not installed: install Helm 3 (the chart's templates need it to render)"
fi
kubectl -n "$OPERATOR_NAMESPACE" rollout status deployment/governor-operator --timeout=180s

log "InferenceService $NAME (engine $ENGINE_IMAGE, model $MODEL_URI)"
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
  kubectl -n "$OPERATOR_NAMESPACE" logs deployment/governor-operator --tail=100 || true
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
PF=$!
trap 'kill $PF 2>/dev/null || true; cleanup' EXIT
answer=""
for _ in $(seq 1 30); do
  answer=$(curl -sf --max-time 60 http://127.0.0.1:18000/v1/completions -H 'Content-Type: application/json' \
    -d "{\"model\": \"$served\", \"prompt\": \"Hello\", \"max_tokens\": 8}" || true)
  [ -n "$answer" ] && break
  sleep 2
done
kill $PF 2>/dev/null || true
grep -q '"choices"' <<<"$answer" || fail "no completion from service/$NAME: $answer"
log "completion: $answer"

log "canary rollout: a static engine change is a new revision, walked through two short steps and promoted"
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
