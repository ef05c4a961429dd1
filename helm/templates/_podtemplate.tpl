{{/*
Pod template of a PyTorchJob replica. Called with (dict "ctx" $ "replica" "master"|"worker" "nodes" N "nproc" P).
The Master pod also runs the budget-watcher as a native sidecar (an initContainer with
restartPolicy: Always): it starts first, shares /run/pretrain with the trainer, and the kubelet stops it
when the trainer exits, so the pod (and the job) completes with the trainer's exit code.
*/}}
{{- define "pretrain.podTemplate" -}}
{{- $ := .ctx }}
{{- $v := $.Values }}
{{- $master := eq .replica "master" }}
{{- $watcher := and $master (include "pretrain.watcherEnabled" $) }}
{{- $run := include "pretrain.runName" $ }}
{{- $res := deepCopy $v.trainer.resources }}
{{- $limits := default dict $res.limits }}
{{- $requests := default dict $res.requests }}
{{- $_ := set $limits $v.gpuResource (.nproc | int) }}
{{- $_ := set $requests $v.gpuResource (.nproc | int) }}
{{- $_ := set $res "limits" $limits }}
{{- $_ := set $res "requests" $requests }}
metadata:
  labels:
    {{- include "pretrain.selectorLabels" $ | nindent 4 }}
    app.kubernetes.io/component: trainer
    pretrain/replica-type: {{ .replica }}
    {{- with $v.trainer.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include (print $.Template.BasePath "/configmap.yaml") $ | sha256sum }}
    kubectl.kubernetes.io/default-container: pytorch
    {{- with $v.trainer.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "pretrain.serviceAccountName" $ }}
  # No API token for the trainer; the watcher alone gets one (the kube-api-access volume below).
  automountServiceAccountToken: false
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ $v.trainer.terminationGracePeriodSeconds }}
  {{- with $v.job.priorityClassName }}
  priorityClassName: {{ . | quote }}
  {{- end }}
  {{- with $v.job.schedulerName }}
  schedulerName: {{ . | quote }}
  {{- end }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.trainer.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.trainer.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.trainer.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if or $watcher $v.prepare.enabled }}
  initContainers:
    {{- if $watcher }}
    - name: budget-watcher
      image: {{ include "pretrain.image" $ }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      restartPolicy: Always
      command: ["pretrain"]
      args:
        - watch
        - --cap-usd
        - {{ $v.budget.capUSD | toString | quote }}
        - --gpus
        - {{ $v.gpus | int | quote }}
        {{- with $v.budget.gpuType }}
        - --gpu-type
        - {{ . | quote }}
        {{- end }}
        {{- if gt (float64 $v.budget.pricePerGpuHour) 0.0 }}
        - --price-per-gpu-hour
        - {{ $v.budget.pricePerGpuHour | toString | quote }}
        {{- end }}
        - --source
        - {{ $v.budget.source | quote }}
        {{- with $v.budget.sourcePath }}
        - --source-path
        - {{ . | quote }}
        {{- end }}
        {{- with $v.budget.opencostUrl }}
        - --opencost-url
        - {{ . | quote }}
        {{- end }}
        {{- if eq $v.budget.source "opencost" }}
        - --opencost-selector
        - {{ default (printf "label:training.kubeflow.org/job-name:%s" (include "pretrain.fullname" $)) $v.budget.opencostSelector | quote }}
        {{- end }}
        - --config
        - /etc/pretrain/config.yaml
        - --run-dir
        - {{ printf "/ckpt/%s" $run | quote }}
        - --stop-file
        - /run/pretrain/stop.json
        - --metrics-port
        - "9401"
        # A native sidecar is stopped by the kubelet when the trainer exits; exiting on its own
        # would only make the kubelet restart it.
        - --no-exit-when-done
        - --kube
        - {{ $v.budget.watcher.kubernetesActions | ternary "auto" "off" | quote }}
        - --job-name
        - {{ include "pretrain.fullname" $ | quote }}
        {{- range $v.budget.watcher.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        - name: POD_NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
      ports:
        - name: budget-metrics
          containerPort: 9401
          protocol: TCP
      # Training does not start until the guard serves its metrics: no unguarded spend.
      startupProbe:
        httpGet:
          path: /metrics
          port: budget-metrics
        periodSeconds: 2
        failureThreshold: 60
      resources:
        {{- toYaml $v.budget.watcher.resources | nindent 8 }}
      {{- with $v.containerSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: config
          mountPath: /etc/pretrain
          readOnly: true
        - name: ckpt
          mountPath: /ckpt
        - name: run
          mountPath: /run/pretrain
        {{- if $v.budget.watcher.kubernetesActions }}
        - name: kube-api-access
          mountPath: /var/run/secrets/kubernetes.io/serviceaccount
          readOnly: true
        {{- end }}
    {{- end }}
    {{- if $v.prepare.enabled }}
    - name: wait-for-data
      image: {{ include "pretrain.image" $ }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command:
        - sh
        - -c
        - |
          marker="/data/$PREPARE_DIR/_READY"; waited=0
          until [ "$(cat "$marker" 2>/dev/null)" = "$PREPARE_FINGERPRINT" ]; do
            if [ -f /run/pretrain/stop.json ]; then
              echo "wait-for-data: stop file present, starting the trainer so that it stops"; exit 0
            fi
            if [ "$WAIT_TIMEOUT" -gt 0 ] && [ "$waited" -ge "$WAIT_TIMEOUT" ]; then
              echo "wait-for-data: no $marker ($PREPARE_FINGERPRINT) after ${waited}s; check: kubectl logs job/$PREPARE_JOB" >&2
              exit 1
            fi
            echo "wait-for-data: waiting for $marker ($PREPARE_FINGERPRINT) from job/$PREPARE_JOB, ${waited}s"
            sleep "$WAIT_POLL"; waited=$((waited + WAIT_POLL))
          done
          echo "wait-for-data: /data/$PREPARE_DIR is ready"
      env:
        - name: PREPARE_DIR
          value: {{ $v.prepare.outputDir | quote }}
        - name: PREPARE_FINGERPRINT
          value: {{ include "pretrain.prepareFingerprint" $ | quote }}
        - name: PREPARE_JOB
          value: {{ printf "%s-prepare" (include "pretrain.fullname" $) | quote }}
        - name: WAIT_POLL
          value: {{ $v.prepare.wait.pollSeconds | int | quote }}
        - name: WAIT_TIMEOUT
          value: {{ $v.prepare.wait.timeoutSeconds | int | quote }}
      resources:
        requests:
          cpu: 10m
          memory: 16Mi
        limits:
          memory: 64Mi
      {{- with $v.containerSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: data
          mountPath: /data
          readOnly: true
        - name: run
          mountPath: /run/pretrain
    {{- end }}
  {{- end }}
  containers:
    - name: pytorch
      image: {{ include "pretrain.image" $ }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      # torchrun, keeping the trainer's exit code for the ExitCode restart policy (see app/launch.py).
      command: ["python", "-m", "app.launch"]
      args:
        - --nnodes={{ .nodes }}
        - --nproc-per-node={{ .nproc }}
        - --max-restarts=0
        - -m
        - app.train
        - --config
        - /etc/pretrain/config.yaml
        - --out
        - {{ printf "/ckpt/%s" $run | quote }}
        - --stop-file
        - /run/pretrain/stop.json
        - --metrics-port
        - "9400"
        - --set
        - budget.in_process=false
        - --budget-cap-usd
        - {{ $v.budget.capUSD | toString | quote }}
        - --gpus
        - {{ $v.gpus | int | quote }}
        {{- if gt (float64 $v.budget.pricePerGpuHour) 0.0 }}
        - --price-per-gpu-hour
        - {{ $v.budget.pricePerGpuHour | toString | quote }}
        {{- end }}
        {{- with $v.budget.gpuType }}
        - --set
        - {{ printf "budget.gpu_type=%s" . | quote }}
        {{- end }}
        {{- if $v.prepare.enabled }}
        - --set
        - {{ printf "data.dataset=/data/%s" $v.prepare.outputDir | quote }}
        {{- end }}
        {{- range $v.extraTrainArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        - name: TORCH_ELASTIC_SHUTDOWN_TIMEOUT
          value: {{ max 30 (sub ($v.trainer.terminationGracePeriodSeconds | int) 30) | quote }}
        {{- with (include "pretrain.hfTokenEnv" $ | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $v.trainer.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.trainer.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      ports:
        - name: pytorchjob-port
          containerPort: 23456
          protocol: TCP
        - name: metrics
          containerPort: 9400
          protocol: TCP
      resources:
        {{- toYaml $res | nindent 8 }}
      {{- with $v.containerSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: config
          mountPath: /etc/pretrain
          readOnly: true
        - name: data
          mountPath: /data
          readOnly: true
        - name: ckpt
          mountPath: /ckpt
        - name: run
          mountPath: /run/pretrain
        - name: dshm
          mountPath: /dev/shm
        {{- with $v.trainer.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "pretrain.fullname" $ }}-config
    - name: data
      persistentVolumeClaim:
        claimName: {{ include "pretrain.dataClaim" $ }}
    - name: ckpt
      persistentVolumeClaim:
        claimName: {{ include "pretrain.ckptClaim" $ }}
    - name: run
      emptyDir:
        sizeLimit: 16Mi
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.trainer.shmSizeLimit }}
    {{- if and $watcher $v.budget.watcher.kubernetesActions }}
    # What automountServiceAccountToken would mount, for the budget-watcher container only.
    - name: kube-api-access
      projected:
        defaultMode: 0444
        sources:
          - serviceAccountToken:
              path: token
              expirationSeconds: 3607
          - configMap:
              name: kube-root-ca.crt
              items:
                - key: ca.crt
                  path: ca.crt
          - downwardAPI:
              items:
                - path: namespace
                  fieldRef:
                    fieldPath: metadata.namespace
    {{- end }}
    {{- with $v.trainer.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
