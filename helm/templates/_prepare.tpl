{{/*
Pod template of the prepare Job. Its hash names the Job (pretrain.prepareJobName), so an upgrade that
changes it creates a new Job rather than failing on the immutable spec.template of the old one; the new
Job finds the marker of unchanged arguments and exits at once.

The script: a marker with the same fingerprint means this exact output exists already. `pretrain prepare`
resumes a half-done output; only on success is DIR/_READY written (atomically: temp file, rename). On
failure it writes DIR/_FAILED for the trainer's wait step, marked final when the Job will not try again:
exit 2 (bad arguments; the podFailurePolicy fails the Job at once) or more failures than backoffLimit.
SIGTERM/SIGINT (130/143: preemption, eviction) are not counted, as the podFailurePolicy ignores them.
*/}}
{{- define "pretrain.prepareTemplate" -}}
{{- $v := .Values -}}
metadata:
  labels:
    {{- include "pretrain.selectorLabels" . | nindent 4 }}
    app.kubernetes.io/component: prepare
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
  {{- else if and $v.job.enabled (not $d.existingClaim) (not (has "ReadWriteMany" $d.accessModes)) }}
  # A ReadWriteOnce data volume is mounted by one node: run on the node of the trainer's Master pod,
  # whose wait-for-data step holds the volume already (else both pods hang on Multi-Attach).
  affinity:
    podAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        - topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "pretrain.selectorLabels" . | nindent 14 }}
              app.kubernetes.io/component: trainer
              pretrain/replica-type: {{ include "pretrain.trainJob" . | empty | ternary "master" "node" }}
  {{- end }}
  {{- if include "pretrain.volumePermissions" . }}
  initContainers:
    {{- include "pretrain.volumePermissionsContainer" (dict "ctx" . "dirs" (list "/data" (printf "/data/%s" $v.prepare.outputDir)) "mounts" (list (dict "name" "data" "mountPath" "/data"))) | nindent 4 }}
  {{- end }}
  containers:
    - name: prepare
      image: {{ include "pretrain.image" . }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command:
        - sh
        - -c
        - |
          set -eu
          out="/data/$PREPARE_DIR"; marker="$out/_READY"
          if [ "$(cat "$marker" 2>/dev/null)" = "$PREPARE_FINGERPRINT" ]; then
            echo "prepare: $out is ready ($PREPARE_FINGERPRINT), nothing to do"; exit 0
          fi
          if ! { mkdir -p "$out" && touch "$out/.write-test" && rm -f "$out/.write-test"; } 2>/dev/null; then
            echo "prepare: $out is not writable as uid $(id -u) gid $(id -g): keep volumePermissions.enabled=true, or give the data volume's root to that uid/gid (fsGroup is not applied to ReadWriteMany volumes of most CSI drivers)" >&2
            exit 2
          fi
          rm -f "$marker"
          rc=0; pretrain prepare "$@" || rc=$?
          if [ "$rc" -ne 0 ]; then
            n=0; [ "$(cut -d' ' -f1 "$out/_FAILURES" 2>/dev/null)" = "$PREPARE_FINGERPRINT" ] && n=$(cut -d' ' -f2 "$out/_FAILURES")
            final=false
            case "$rc" in
              130|143) ;;
              *) n=$((n + 1)); printf '%s %s\n' "$PREPARE_FINGERPRINT" "$n" > "$out/_FAILURES"
                 if [ "$rc" -eq 2 ] || [ "$n" -gt "$PREPARE_BACKOFF_LIMIT" ]; then final=true; fi ;;
            esac
            printf '{"fingerprint": "%s", "exit_code": %d, "failures": %d, "backoff_limit": %d, "final": %s, "pod": "%s"}\n' \
              "$PREPARE_FINGERPRINT" "$rc" "$n" "$PREPARE_BACKOFF_LIMIT" "$final" "$(hostname)" > "$out/_FAILED.tmp"
            mv "$out/_FAILED.tmp" "$out/_FAILED"
            echo "prepare: pretrain prepare exited $rc (failure $n, backoffLimit $PREPARE_BACKOFF_LIMIT, final: $final)" >&2
            exit "$rc"
          fi
          rm -f "$out/_FAILED" "$out/_FAILURES"
          printf '%s\n' "$PREPARE_FINGERPRINT" > "$marker.tmp"
          mv "$marker.tmp" "$marker"
          echo "prepare: wrote $marker ($PREPARE_FINGERPRINT)"
        - prepare
      args:
        {{- include "pretrain.prepareArgs" . | nindent 8 }}
      env:
        - name: PREPARE_DIR
          value: {{ $v.prepare.outputDir | quote }}
        - name: PREPARE_FINGERPRINT
          value: {{ include "pretrain.prepareFingerprint" . | quote }}
        - name: PREPARE_BACKOFF_LIMIT
          value: {{ $v.prepare.backoffLimit | int | quote }}
        - name: HF_HOME
          value: /data/.cache/huggingface
        {{- with (include "pretrain.hfTokenEnv" . | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $v.prepare.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      resources:
        {{- toYaml $v.prepare.resources | nindent 8 }}
      terminationMessagePolicy: FallbackToLogsOnError
      {{- with $v.containerSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: data
          mountPath: /data
  volumes:
    - name: data
      persistentVolumeClaim:
        claimName: {{ include "pretrain.dataClaim" . }}
{{- end }}
