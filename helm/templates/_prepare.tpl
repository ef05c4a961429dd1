{{/*
Pod template of the prepare Jobs, called with (dict "ctx" $ "role" "prepare"|"finalizer"). Its hash names
the Job (pretrain.prepareJobName), so an upgrade that changes it creates a new Job rather than failing on the
immutable spec.template of the old one; the new Job finds the marker of unchanged arguments and exits at once.

The pod runs `python -m app.data.prepare_job` (app/data/prepare_job.py). The prepare pods (`run`): a marker
DIR/_READY holding the fingerprint of the prepare arguments means this exact output exists; else `pretrain
prepare` (which resumes a half-done output), then on success the marker, written atomically. A failure
writes DIR/_FAILED for the finalizer and the trainer's wait step, marked final when the Job will not try
again (exit 2, or more failures than backoffLimit; SIGTERM/SIGINT are not counted, as the podFailurePolicy
ignores disruptions). They parse downloaded files and hold no API token. The training job is created
suspended; the finalizer (`finalize`, a small pod that parses no download: with prepare.parallelism N > 1 it
joins the N shares) waits for the marker and releases it, with a token of its own ServiceAccount mounted in
that container alone; a final failure leaves the job suspended with a PrepareFailed Event and the condition
DataReady=False.
*/}}
{{- define "pretrain.prepareTemplate" -}}
{{- $ := .ctx -}}
{{- $v := $.Values -}}
{{- $finalizer := eq .role "finalizer" -}}
{{- $shares := int $v.prepare.parallelism -}}
metadata:
  labels:
    {{- include "pretrain.selectorLabels" $ | nindent 4 }}
    app.kubernetes.io/component: prepare
    pretrain/prepare-role: {{ .role }}
    {{- with $v.commonLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with $v.prepare.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- if or $v.commonAnnotations $v.prepare.podAnnotations }}
  annotations:
    {{- with $v.commonAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with $v.prepare.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
spec:
  restartPolicy: Never
  serviceAccountName: {{ include "pretrain.prepareServiceAccountName" $ }}
  # The token is mounted (kube-api-access below) only in the finalizer, which releases the training job.
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
  {{- with $v.prepare.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.prepare.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $d := $v.storage.data }}
  {{- if $v.prepare.affinity }}
  affinity:
    {{- toYaml $v.prepare.affinity | nindent 4 }}
  {{- else if and (eq $shares 1) (include "pretrain.prepareFinalizer" $) (not $d.existingClaim) (not (has "ReadWriteMany" $d.accessModes)) }}
  # A ReadWriteOnce data volume is mounted by one node: the prepare pod and its finalizer run on one node
  # (the first of them anywhere), else the second hangs on Multi-Attach and they would wait for each other.
  affinity:
    podAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        - topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "pretrain.selectorLabels" $ | nindent 14 }}
              app.kubernetes.io/component: prepare
  {{- end }}
  {{- if include "pretrain.volumePermissions" $ }}
  initContainers:
    {{- include "pretrain.volumePermissionsContainer" (dict "ctx" $ "dirs" (list "/data" (printf "/data/%s" $v.prepare.outputDir)) "mounts" (list (dict "name" "data" "mountPath" "/data"))) | nindent 4 }}
  {{- end }}
  containers:
    - name: prepare
      image: {{ include "pretrain.image" $ }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command: ["python", "-m", "app.data.prepare_job"]
      args:
        - {{ $finalizer | ternary "finalize" "run" }}
        - --dir
        - {{ printf "/data/%s" $v.prepare.outputDir | quote }}
        - --fingerprint
        - {{ include "pretrain.prepareFingerprint" $ | quote }}
        - --backoff-limit
        - {{ $v.prepare.backoffLimit | int | quote }}
        {{- if and $finalizer $v.job.enabled }}
        - --job
        - {{ printf "%s/%s" (include "pretrain.trainJob" $ | empty | ternary "PyTorchJob" "TrainJob") (include "pretrain.fullname" $) | quote }}
        {{- with $v.job.kueueQueueName }}
        - --queue
        - {{ . | quote }}
        {{- end }}
        {{- end }}
        {{- if gt $shares 1 }}
        - --shard-count
        - {{ $shares | quote }}
        {{- end }}
        {{- if $finalizer }}
        - --prepare-job
        - {{ include "pretrain.prepareJobName" $ | quote }}
        {{- end }}
        - --
        {{- include "pretrain.prepareArgs" $ | nindent 8 }}
      env:
        - name: POD_NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
        # This Job's uid: failures of an earlier Job of the same arguments are not counted against this one.
        - name: PRETRAIN_JOB_UID
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['batch.kubernetes.io/controller-uid']
        - name: HF_HOME
          value: /data/.cache/huggingface
        {{- with (include "pretrain.hfTokenEnv" $ | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $v.prepare.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      resources:
        {{- toYaml ($finalizer | ternary $v.prepare.finalizer.resources $v.prepare.resources) | nindent 8 }}
      terminationMessagePolicy: FallbackToLogsOnError
      {{- with $v.containerSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: data
          mountPath: /data
        {{- if $finalizer }}
        - name: kube-api-access
          mountPath: /var/run/secrets/kubernetes.io/serviceaccount
          readOnly: true
        {{- end }}
  volumes:
    - name: data
      persistentVolumeClaim:
        claimName: {{ include "pretrain.dataClaim" $ }}
    {{- if $finalizer }}
    {{- include "pretrain.kubeApiVolume" $ | nindent 4 }}
    {{- end }}
{{- end }}
