{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "graphcache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: release-chart, unless the release name already contains the chart name. */}}
{{- define "graphcache.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "graphcache.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "graphcache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "graphcache.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "graphcache.labels" -}}
helm.sh/chart: {{ include "graphcache.chart" . }}
{{ include "graphcache.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: inference
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "graphcache.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "graphcache.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "graphcache.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* Name of the Secret holding the admin token: the existing one, or the one this chart creates. */}}
{{- define "graphcache.adminSecretName" -}}
{{- if .Values.adminToken.existingSecret }}
{{- .Values.adminToken.existingSecret }}
{{- else }}
{{- printf "%s-admin" (include "graphcache.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "graphcache.adminSecretKey" -}}
{{- if .Values.adminToken.existingSecret }}
{{- .Values.adminToken.existingSecretKey }}
{{- else }}admin-token{{- end }}
{{- end }}

{{/* Claim name of the model volume: the existing claim, or the one this chart creates. */}}
{{- define "graphcache.modelClaimName" -}}
{{- if .Values.model.pvc.existingClaim }}
{{- .Values.model.pvc.existingClaim }}
{{- else }}
{{- printf "%s-models" (include "graphcache.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* GRAPHCACHE_MODEL: mountPath/path, or empty when no model volume is mounted (embedded tiny model). */}}
{{- define "graphcache.modelPath" -}}
{{- if ne .Values.model.source "none" }}
{{- if .Values.model.path }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.path) }}
{{- else }}
{{- .Values.model.mountPath }}
{{- end }}
{{- end }}
{{- end }}

{{/* An env value from a values entry: strings as they are, anything else (lists, numbers, bools) as JSON,
     which is how pydantic-settings reads GRAPHCACHE_* (lists must be JSON). */}}
{{- define "graphcache.envValue" -}}
{{- if kindIs "string" . }}{{ . | quote }}{{ else }}{{ toJson . | quote }}{{ end }}
{{- end }}

{{/* "true" when the model volume is a PersistentVolumeClaim: model.source=pvc, or hub with hub.volume=pvc. */}}
{{- define "graphcache.modelOnClaim" -}}
{{- if or (eq .Values.model.source "pvc") (and (eq .Values.model.source "hub") (eq .Values.model.hub.volume "pvc")) }}true{{ end }}
{{- end }}

{{/* GRAPHCACHE_SERVED_MODEL_NAME: model.servedModelName, else the hub repo id for source=hub, else empty
     (the server then uses the directory name). */}}
{{- define "graphcache.servedModelName" -}}
{{- if .Values.model.servedModelName }}
{{- .Values.model.servedModelName }}
{{- else if eq .Values.model.source "hub" }}
{{- .Values.model.hub.repoId }}
{{- end }}
{{- end }}

{{/* The router's own labels: never the replicas' selector labels, so the graphcache Service and the
router's service discovery never select router pods. */}}
{{- define "graphcache.routerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "graphcache.name" . }}-router
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "graphcache.routerLabels" -}}
helm.sh/chart: {{ include "graphcache.chart" . }}
{{ include "graphcache.routerSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: router
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}
