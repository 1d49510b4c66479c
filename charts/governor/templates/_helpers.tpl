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
