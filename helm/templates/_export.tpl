{{/*
The export after training (export.enabled): two Jobs on the CPU pool, and the checks of their values.

- The export Job (pretrain.exportJobName) runs `pretrain export /ckpt/<run> --output <folder> --format hf`
  and, with export.push.repo, then `pretrain push <folder> --repo ...` with HF_TOKEN from a Secret
  (secretKeyRef). It mounts the checkpoint volume (read-write only when the folder is written there) and
  holds no API token. It is created suspended: no pod, so no volume is attached and no node held, while the
  run trains; a ReadWriteOnce volume attaches to its node only once the trainer pods are gone.
- The wait Job (pretrain.exportWaitJobName) runs `python -m app.tools.export_job` (app/tools/export_job.py):
  it waits for the training job to end and its pods to be gone, then releases the export Job (or, after a
  failed run with export.onFailure=skip, leaves it suspended with an ExportSkipped Event). It holds the
  export side's only API token (its own Role, export-rbac.yaml) and mounts no volume.
With job.enabled=false there is no training job to wait for: the export Job runs at once, on a run already on
the volume, and there is no wait Job.
Both are named per hash of their pod template (and of pretrain.prepareNonce), so a `helm upgrade` that
changes them (a repo named after the run) creates new Jobs rather than failing on an immutable template.
*/}}

{{/* Does the release export after training? "true" or "". */}}
{{- define "pretrain.export" -}}
{{- if and .Values.export.enabled (include "pretrain.training" .) }}true{{ end -}}
{{- end }}

{{/* Is a push rendered: a repo named (its token Secret is then required by pretrain.validateExport). */}}
{{- define "pretrain.exportPush" -}}
{{- if and (include "pretrain.export" .) .Values.export.push.repo }}true{{ end -}}
{{- end }}

{{/* Does the export write its folder to the checkpoint volume (mounted read-write by the export step)? */}}
{{- define "pretrain.exportOnVolume" -}}
{{- if .Values.export.keepOnVolume }}true{{ end -}}
{{- end }}

{{/* The folder the export writes and the push reads. */}}
{{- define "pretrain.exportOutput" -}}
{{- if include "pretrain.exportOnVolume" . -}}
/ckpt/{{ default (printf "%s-hf" (include "pretrain.runName" .)) .Values.export.output }}
{{- else -}}
/scratch/export
{{- end -}}
{{- end }}

{{/* The training job's pods, as a label selector (the chart's own labels: the same for both operators). */}}
{{- define "pretrain.trainerPodSelector" -}}
{{- $labels := include "pretrain.selectorLabels" . | fromYaml -}}
{{- $_ := set $labels "app.kubernetes.io/component" "trainer" -}}
{{- $pairs := list -}}
{{- range $k := keys $labels | sortAlpha }}{{ $pairs = append $pairs (printf "%s=%s" $k (index $labels $k)) }}{{ end -}}
{{- join "," $pairs -}}
{{- end }}

{{- define "pretrain.exportJobName" -}}
{{- $hash := printf "%s%s" (include "pretrain.exportTemplate" (dict "ctx" . "role" "export")) (include "pretrain.prepareNonce" .) | sha256sum | trunc 8 -}}
{{- printf "%s-export-%s" (include "pretrain.fullname" . | trunc 42 | trimSuffix "-") $hash -}}
{{- end }}

{{- define "pretrain.exportWaitJobName" -}}
{{- $hash := printf "%s%s" (include "pretrain.exportTemplate" (dict "ctx" . "role" "wait")) (include "pretrain.prepareNonce" .) | sha256sum | trunc 8 -}}
{{- printf "%s-export-wait-%s" (include "pretrain.fullname" . | trunc 37 | trimSuffix "-") $hash -}}
{{- end }}

{{/* The export side's ServiceAccount: its own (only the export's Role is bound to it), or the given one. */}}
{{- define "pretrain.exportServiceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- printf "%s-export" (include "pretrain.fullname" .) }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Render-time refusals of the export values (called from pretrain.validate). */}}
{{- define "pretrain.validateExport" -}}
{{- $e := .Values.export -}}
{{- if include "pretrain.export" . -}}
{{- $out := $e.output -}}
{{- $run := include "pretrain.runName" . -}}
{{- if or (eq $out $run) (hasPrefix (printf "%s/" $run) $out) -}}
{{- fail (printf "export.output=%s is inside the run directory /ckpt/%s, which is the trainer's: pick a path beside it, e.g. %s-hf (the default)" $out $run $run) -}}
{{- end -}}
{{- if $e.push.repo -}}
{{- if ne $e.format "hf" -}}
{{- fail (printf "export.push.repo=%s with export.format=%s: the Hub takes the Hugging Face folder; use export.format=hf" $e.push.repo $e.format) -}}
{{- end -}}
{{- if or (contains "--" $e.push.repo) (contains ".." $e.push.repo) (hasSuffix ".git" $e.push.repo) -}}
{{- fail (printf "export.push.repo=%s: a Hub repo is ORG/NAME with no '--' or '..' and not ending in '.git'" $e.push.repo) -}}
{{- end -}}
{{- if not $e.push.tokenSecret.name -}}
{{- fail (printf "export.push.repo=%s needs export.push.tokenSecret.name: a Secret holding a Hugging Face token with write access (kubectl create secret generic hf-write-token --from-literal=token=hf_...), given to the push as HF_TOKEN" $e.push.repo) -}}
{{- end -}}
{{- else if not $e.keepOnVolume -}}
{{- fail "export.keepOnVolume=false writes the folder to the pod's scratch space, which goes with the pod: it needs export.push.repo (and its token Secret), or keep the folder on the checkpoint volume" -}}
{{- end -}}
{{- if and .Values.job.enabled (not .Values.serviceAccount.create) (not .Values.serviceAccount.name) .Values.rbac.create -}}
{{- fail "serviceAccount.create=false without serviceAccount.name: the export's Role would be bound to the namespace's `default` ServiceAccount, which every other pod there uses. Set serviceAccount.name, or rbac.create=false (and grant it yourself)" -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/*
Pod template of the export Jobs, called with (dict "ctx" $ "role" "export"|"wait"); its hash names the Job.
*/}}
{{- define "pretrain.exportTemplate" -}}
{{- $ := .ctx -}}
{{- $v := $.Values -}}
{{- $e := $v.export -}}
{{- $wait := eq .role "wait" -}}
{{- $push := include "pretrain.exportPush" $ | empty | not -}}
{{- $onVolume := include "pretrain.exportOnVolume" $ | empty | not -}}
{{- $out := include "pretrain.exportOutput" $ -}}
metadata:
  labels:
    {{- include "pretrain.selectorLabels" $ | nindent 4 }}
    app.kubernetes.io/component: export
    pretrain/export-role: {{ .role }}
    {{- with $v.commonLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with $e.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- if or $v.commonAnnotations $e.podAnnotations }}
  annotations:
    {{- with $v.commonAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with $e.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
spec:
  restartPolicy: Never
  serviceAccountName: {{ include "pretrain.exportServiceAccountName" $ }}
  # The API token is mounted (kube-api-access below) in the wait pod alone; the export pod holds none.
  automountServiceAccountToken: false
  enableServiceLinks: false
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- /* The CPU pool: the export's own selection, else the prepare's. */}}
  {{- with (default $v.prepare.nodeSelector $e.nodeSelector) }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with (default $v.prepare.tolerations $e.tolerations) }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $e.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $wait }}
  containers:
    - name: wait
      image: {{ include "pretrain.image" $ }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command: ["python", "-m", "app.tools.export_job"]
      args:
        - --job
        - {{ printf "%s/%s" (include "pretrain.trainJob" $ | empty | ternary "PyTorchJob" "TrainJob") (include "pretrain.fullname" $) | quote }}
        - --export-job
        - {{ include "pretrain.exportJobName" $ | quote }}
        - --pods
        - {{ include "pretrain.trainerPodSelector" $ | quote }}
        - --on-failure
        - {{ $e.onFailure | quote }}
        - --poll
        - {{ $e.wait.pollSeconds | int | quote }}
      env:
        - name: POD_NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
      resources:
        {{- toYaml $e.wait.resources | nindent 8 }}
      terminationMessagePolicy: FallbackToLogsOnError
      {{- with $v.containerSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: kube-api-access
          mountPath: /var/run/secrets/kubernetes.io/serviceaccount
          readOnly: true
  volumes:
    {{- include "pretrain.kubeApiVolume" $ | nindent 4 }}
  {{- else }}
  {{- $perms := and $onVolume (include "pretrain.volumePermissions" $) }}
  {{- if or $perms $push }}
  initContainers:
    {{- if $perms }}
    {{- include "pretrain.volumePermissionsContainer" (dict "ctx" $ "dirs" (list "/ckpt") "mounts" (list (dict "name" "ckpt" "mountPath" "/ckpt"))) | nindent 4 }}
    {{- end }}
    {{- if $push }}
    # First the export, without the token; then the push, which holds it.
    {{- include "pretrain.exportContainer" $ | nindent 4 }}
    {{- end }}
  {{- end }}
  containers:
    {{- if $push }}
    - name: push
      image: {{ include "pretrain.image" $ }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      args:
        - push
        - {{ $out | quote }}
        - --repo
        - {{ $e.push.repo | quote }}
        {{- if $e.push.private }}
        - --private
        {{- end }}
        {{- with $e.push.revision }}
        - --revision
        - {{ . | quote }}
        {{- end }}
        {{- with $e.push.commitMessage }}
        - --commit-message
        - {{ . | quote }}
        {{- end }}
      env:
        # The token from the Secret alone (never in values or arguments); never printed by the push.
        - name: HF_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ $e.push.tokenSecret.name | quote }}
              key: {{ $e.push.tokenSecret.key | quote }}
        # huggingface_hub's caches (the upload's), in the pod's scratch space
        - name: HF_HOME
          value: /scratch/huggingface
      resources:
        {{- toYaml $e.resources | nindent 8 }}
      terminationMessagePolicy: FallbackToLogsOnError
      {{- with $v.containerSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: ckpt
          mountPath: /ckpt
          readOnly: true
        - name: scratch
          mountPath: /scratch
    {{- else }}
    {{- include "pretrain.exportContainer" $ | nindent 4 }}
    {{- end }}
  volumes:
    - name: ckpt
      persistentVolumeClaim:
        claimName: {{ include "pretrain.ckptClaim" $ }}
        {{- if not $onVolume }}
        readOnly: true
        {{- end }}
    - name: scratch
      emptyDir:
        sizeLimit: {{ $e.scratchSizeLimit | quote }}
  {{- end }}
{{- end }}

{{/* The export step: `pretrain export` of the run into the folder, read-write on the volume only when the
folder is written there. The folder is the chart's: every export replaces it (--force: a retried pod, a new
revision). */}}
{{- define "pretrain.exportContainer" -}}
{{- $v := .Values -}}
{{- $e := $v.export -}}
{{- $onVolume := include "pretrain.exportOnVolume" . | empty | not -}}
- name: export
  image: {{ include "pretrain.image" . }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  args:
    - export
    - {{ printf "/ckpt/%s" (include "pretrain.runName" .) | quote }}
    - --output
    - {{ include "pretrain.exportOutput" . | quote }}
    - --format
    - {{ $e.format | quote }}
    {{- if eq $e.format "hf" }}
    - --dtype
    - {{ $e.dtype | quote }}
    {{- with $e.license }}
    - --license
    - {{ . | quote }}
    {{- end }}
    {{- end }}
    - --force
    {{- range $e.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  resources:
    {{- toYaml $e.resources | nindent 4 }}
  terminationMessagePolicy: FallbackToLogsOnError
  {{- with $v.containerSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: ckpt
      mountPath: /ckpt
      {{- if not $onVolume }}
      readOnly: true
      {{- end }}
    - name: scratch
      mountPath: /scratch
{{- end }}
