{{/* The chart's name, or nameOverride. */}}
{{- define "fsdp-replay.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every resource name: fullnameOverride, else the release name (with the chart's name
appended unless the release name already holds it). Kept at 40 characters so that the longest
suffix ("-webhook-tls", "-certgen-patch") still fits a 63-character name.
*/}}
{{- define "fsdp-replay.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "fsdp-replay.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "fsdp-replay.labels" -}}
helm.sh/chart: {{ include "fsdp-replay.chart" . }}
{{ include "fsdp-replay.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "fsdp-replay.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fsdp-replay.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Names shared by several templates (the certgen Jobs and the tests need them too). */}}
{{- define "fsdp-replay.webhookName" -}}
{{- include "fsdp-replay.fullname" . }}-webhook
{{- end }}

{{- define "fsdp-replay.tlsSecret" -}}
{{- include "fsdp-replay.fullname" . }}-webhook-tls
{{- end }}

{{- define "fsdp-replay.certgenName" -}}
{{- include "fsdp-replay.fullname" . }}-certgen
{{- end }}

{{/* The DNS names the API server uses for the webhook's Service (the serving certificate's SANs). */}}
{{- define "fsdp-replay.dnsNames" -}}
{{- $svc := include "fsdp-replay.webhookName" . -}}
{{- list (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $svc .Release.Namespace) (printf "%s.%s" $svc .Release.Namespace) $svc | toJson }}
{{- end }}

{{/*
An image reference from {repository, tag, digest}: repository@digest when a digest is given (the
tag is then only informative and left out), else repository:tag, the tag defaulting to appVersion.
Call with (dict "image" .Values.x.image "default" "<fallback tag>").
*/}}
{{- define "fsdp-replay.image" -}}
{{- $image := .image -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default .default $image.tag) -}}
{{- end -}}
{{- end }}

{{- define "fsdp-replay.webhookImage" -}}
{{- include "fsdp-replay.image" (dict "image" .Values.webhook.image "default" .Chart.AppVersion) }}
{{- end }}

{{/* The certgen image: its own when a repository is given, else the webhook image (python3 + openssl). */}}
{{- define "fsdp-replay.certgenImage" -}}
{{- if .Values.certgen.image.repository -}}
{{- include "fsdp-replay.image" (dict "image" .Values.certgen.image "default" (default .Chart.AppVersion .Values.webhook.image.tag)) }}
{{- else -}}
{{- include "fsdp-replay.webhookImage" . }}
{{- end -}}
{{- end }}

{{/* Whether the Prometheus operator's objects are rendered. */}}
{{- define "fsdp-replay.monitoring" -}}
{{- if and .Values.monitoring.enabled (or .Values.monitoring.force (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) -}}
true
{{- end -}}
{{- end }}

{{/* The restricted Pod Security profile's container settings, shared by every pod of the chart. */}}
{{- define "fsdp-replay.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "fsdp-replay.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end }}
