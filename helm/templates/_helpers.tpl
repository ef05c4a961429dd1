{{/*
Names, labels and the run topology shared by every template.
*/}}

{{- define "pretrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified name. The PyTorchJob gets it; its pods are <fullname>-master-0 and <fullname>-worker-N,
so it is kept to 50 characters to leave room for those suffixes.
*/}}
{{- define "pretrain.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pretrain.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pretrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pretrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pretrain.labels" -}}
helm.sh/chart: {{ include "pretrain.chart" . }}
{{ include "pretrain.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pretrain
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* metadata.annotations body for every object (may be empty). */}}
{{- define "pretrain.annotations" -}}
{{- with .Values.commonAnnotations }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{- define "pretrain.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}
{{- end }}
{{- end }}

{{- define "pretrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pretrain.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pretrain.runName" -}}
{{- default (include "pretrain.fullname" .) .Values.runName }}
{{- end }}

{{- define "pretrain.dataClaim" -}}
{{- default (printf "%s-data" (include "pretrain.fullname" .)) .Values.storage.data.existingClaim }}
{{- end }}

{{- define "pretrain.ckptClaim" -}}
{{- default (printf "%s-ckpt" (include "pretrain.fullname" .)) .Values.storage.checkpoints.existingClaim }}
{{- end }}

{{/*
Topology: validates gpus / gpusPerNode and returns "<nodes> <nprocPerNode>".
  gpus <  gpusPerNode -> 1 node with gpus processes
  gpus >= gpusPerNode -> gpus/gpusPerNode nodes with gpusPerNode processes, refused unless it divides
*/}}
{{- define "pretrain.topology" -}}
{{- $gpus := int .Values.gpus -}}
{{- $per := int .Values.gpusPerNode -}}
{{- if lt $gpus 1 -}}
{{- fail (printf "gpus=%d: a run needs at least 1 GPU" $gpus) -}}
{{- end -}}
{{- if lt $per 1 -}}
{{- fail (printf "gpusPerNode=%d: must be at least 1" $per) -}}
{{- end -}}
{{- if lt $gpus $per -}}
{{- printf "1 %d" $gpus -}}
{{- else if ne (mod $gpus $per) 0 -}}
{{- fail (printf "gpus=%d is not a multiple of gpusPerNode=%d: every node runs gpusPerNode processes, so use gpus=%d or gpus=%d, or set gpusPerNode to a divisor of %d" $gpus $per (mul (div $gpus $per) $per) (mul (add1 (div $gpus $per)) $per) $gpus) -}}
{{- else -}}
{{- printf "%d %d" (div $gpus $per) $per -}}
{{- end -}}
{{- end }}

{{- define "pretrain.nodes" -}}
{{- index (splitList " " (include "pretrain.topology" .)) 0 }}
{{- end }}

{{- define "pretrain.nprocPerNode" -}}
{{- index (splitList " " (include "pretrain.topology" .)) 1 }}
{{- end }}

{{/* Is the budget-watcher sidecar on? Renders "true" or "". */}}
{{- define "pretrain.watcherEnabled" -}}
{{- if and .Values.budget.watcher.enabled (gt (float64 .Values.budget.capUSD) 0.0) }}true{{ end }}
{{- end }}

{{/* Fingerprint of the prepare arguments: the content of the _READY marker. */}}
{{- define "pretrain.prepareArgs" -}}
- --input
- {{ .Values.prepare.input | quote }}
- --out
- {{ printf "/data/%s" .Values.prepare.outputDir | quote }}
- --text-column
- {{ .Values.prepare.textColumn | quote }}
- --tokenizer
- {{ .Values.prepare.tokenizer | quote }}
{{- if eq .Values.prepare.tokenizer "bpe" }}
- --vocab-size
- {{ .Values.prepare.vocabSize | int | quote }}
{{- end }}
- --val-fraction
- {{ .Values.prepare.valFraction | toString | quote }}
- --workers
- {{ .Values.prepare.workers | int | quote }}
{{- range .Values.prepare.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{- define "pretrain.prepareFingerprint" -}}
{{- include "pretrain.prepareArgs" . | sha256sum | trunc 16 }}
{{- end }}

{{/* HF_TOKEN from the existing Secret, if one is named. */}}
{{- define "pretrain.hfTokenEnv" -}}
{{- if .Values.hfToken.existingSecret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.hfToken.existingSecret }}
      key: {{ .Values.hfToken.key }}
{{- end }}
{{- end }}
