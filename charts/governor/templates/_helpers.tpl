{{/* Name of every object of this release. */}}
{{- define "governor.fullname" -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of the chart's objects. */}}
{{- define "governor.labels" -}}
app.kubernetes.io/name: governor-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Namespaces whose engine pods the NetworkPolicy covers: the watched ones, else the release's. */}}
{{- define "governor.engineNamespaces" -}}
{{- if .Values.watchedNamespaces -}}
{{- toJson .Values.watchedNamespaces -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{/*
The operator's rules, the same in its ClusterRole (all namespaces) and in each watched namespace's Role.
Literal on purpose: tests read them as plain YAML. kopf runs --standalone (no kopf.dev peering objects) and
with resource scanning off (API discovery only), so nothing on CustomResourceDefinitions or Namespaces.
*/}}
{{- define "governor.operatorRules" -}}
# Exactly the verbs the operator's calls use: children are read, listed (by label), created, patched and
# deleted, never replaced or watched; only InferenceServices are watched (kopf).
rules:
  # The InferenceServices themselves (kopf patches its finalizer and progress); status is written by the
  # operator and the tuner.
  - apiGroups: ["governor.dev"]
    resources: ["inferenceservices"]
    verbs: ["get", "list", "watch", "patch"]
  - apiGroups: ["governor.dev"]
    resources: ["inferenceservices/status"]
    verbs: ["patch"]
  # Children: stable and canary Deployments, the Services, the engine ConfigMaps.
  - apiGroups: ["apps"]
    resources: ["deployments"]
    verbs: ["get", "list", "create", "patch", "delete"]
  - apiGroups: [""]
    resources: ["services", "configmaps"]
    verbs: ["get", "list", "create", "patch", "delete"]
  # The PodDisruptionBudget, addressed by name.
  - apiGroups: ["policy"]
    resources: ["poddisruptionbudgets"]
    verbs: ["get", "create", "patch", "delete"]
  # The engines' admin-token Secret, only ever addressed by name: created once, read back, deleted with the
  # service. No list or watch: those would expose every Secret's data in the namespace.
  - apiGroups: [""]
    resources: ["secrets"]
    verbs: ["get", "create", "delete"]
  # The tuner lists the ready engine pods of a service's stable revision to reach their admin API (pod IP).
  - apiGroups: [""]
    resources: ["pods"]
    verbs: ["list"]
  # Canary weights on the HTTPRoute a service names (spec.rollout.httpRoute); the route stays the user's.
  - apiGroups: ["gateway.networking.k8s.io"]
    resources: ["httproutes"]
    verbs: ["get", "patch"]
  # Events with stable reasons (kopf posts core/v1 events).
  - apiGroups: [""]
    resources: ["events"]
    verbs: ["create"]
  # One PodMonitor per service when the Prometheus Operator is installed (GOVERNOR_POD_MONITOR); the list is
  # how the operator learns whether that API is served; the garbage collector deletes them with the service.
  - apiGroups: ["monitoring.coreos.com"]
    resources: ["podmonitors"]
    verbs: ["get", "list", "create", "patch"]
{{- end -}}

{{/* "true" when the chart renders its PodMonitor (podMonitor.enabled: auto, true or false), else empty. */}}
{{- define "governor.podMonitorRendered" -}}
{{- $mode := toString .Values.podMonitor.enabled -}}
{{- if not (has $mode (list "auto" "true" "false")) -}}
{{- fail (printf "podMonitor.enabled must be auto, true or false, not %q" $mode) -}}
{{- end -}}
{{- if or (eq $mode "true") (and (eq $mode "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/PodMonitor")) -}}
true
{{- end -}}
{{- end -}}

{{/* The operator image: pinned by digest when image.digest is set, else repository:tag. */}}
{{- define "governor.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}
