{{/*
Pod template of a PyTorchJob replica. Called with (dict "ctx" $ "replica" "master"|"worker" "nodes" N "nproc" P),
plus "bench" true for the benchmark job (bench.enabled). With "launcher" "trainjob" (and "replica" "node") it is
the pod of the TrainingRuntime's `node` Job instead: one template for every node, the trainer container
named `node` (where the torch plugin injects PET_*), restartPolicy Never (for the podFailurePolicy), and the
budget watcher in every pod but watching in node 0's alone (JOB_COMPLETION_INDEX).
Init containers, in order: volume-permissions (root, optional: hands /ckpt to uid 1000), budget-watcher
(Master only; a native sidecar: an initContainer with restartPolicy: Always that starts first, shares
/run/pretrain with the trainer and is stopped by the kubelet when the trainer exits, so the pod ends with
the trainer's exit code; a watcher that cannot start leaves a verdict there instead, which the launcher
turns into exit 2), wait-for-data (`python -m app.data.wait`: waits for the prepare Job's marker, gives
up on a failed or missing prepare and leaves a verdict the launcher turns into exit 4).
The benchmark pod is the trainer pod (image, GPUs, resources, scheduling, /dev/shm, NCCL settings, the
launcher) running `-m app.tools.bench` on synthetic tokens: no volumes but the config, no init steps.
*/}}
{{- define "pretrain.podTemplate" -}}
{{- $ := .ctx }}
{{- $v := $.Values }}
{{- $bench := .bench | default false }}
{{- $tj := eq (.launcher | default "") "trainjob" }}
{{- $master := eq .replica "master" }}
{{- $trainer := $tj | ternary "node" "pytorch" }}
{{- $watcher := and (or $master $tj) (not $bench) (include "pretrain.watcherEnabled" $) }}
{{- $watcherApi := and $watcher (include "pretrain.watcherKube" $) }}
{{- $prepare := and $v.prepare.enabled (not $bench) }}
{{- $waitApi := and $prepare $v.prepare.wait.useKubernetesApi }}
{{- $run := include "pretrain.runName" $ }}
{{- $perms := and (not $bench) (include "pretrain.volumePermissions" $) }}
metadata:
  labels:
    {{- include "pretrain.selectorLabels" $ | nindent 4 }}
    app.kubernetes.io/component: {{ $bench | ternary "bench" "trainer" }}
    pretrain/replica-type: {{ .replica }}
    {{- with $v.commonLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with $v.trainer.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include (print $.Template.BasePath "/configmap.yaml") $ | sha256sum }}
    kubectl.kubernetes.io/default-container: {{ $trainer }}
    {{- if not $v.trainer.safeToEvict }}
    # A node scale-down would kill the whole gang: the autoscalers leave these pods alone.
    cluster-autoscaler.kubernetes.io/safe-to-evict: "false"
    karpenter.sh/do-not-disrupt: "true"
    {{- end }}
    {{- with $v.commonAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with $v.trainer.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "pretrain.serviceAccountName" $ }}
  # No API token for the trainer; the watcher and the wait step alone get one (kube-api-access below).
  automountServiceAccountToken: false
  enableServiceLinks: false
  {{- if $tj }}
  # The Job's podFailurePolicy needs it; the Job recreates a failed pod, or the JobSet the whole gang.
  restartPolicy: Never
  {{- end }}
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
  {{- if or $perms $watcher $prepare }}
  initContainers:
    {{- if $perms }}
    {{- include "pretrain.volumePermissionsContainer" (dict "ctx" $ "dirs" (list "/ckpt" (printf "/ckpt/%s" $run)) "mounts" (list (dict "name" "ckpt" "mountPath" "/ckpt"))) | nindent 4 }}
    {{- end }}
    {{- if $watcher }}
    - name: budget-watcher
      image: {{ include "pretrain.image" $ }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      restartPolicy: Always
      {{- if $tj }}
      # Every node's pod has the sidecar (one template for all nodes): node 0's watches and keeps the
      # ledger; the others idle until the kubelet stops them with the trainer.
      command:
        - sh
        - -c
        - |
          if [ "${JOB_COMPLETION_INDEX:-0}" = 0 ]; then exec pretrain "$@"; fi
          trap 'exit 0' TERM INT
          echo "budget-watcher: node $JOB_COMPLETION_INDEX: the watcher runs in node 0's pod only"
          while :; do sleep 3600 & wait $!; done
        - budget-watcher
      {{- else }}
      command: ["pretrain"]
      {{- end }}
      args:
        {{- include "pretrain.watcherArgs" $ | nindent 8 }}
      env:
        - name: POD_NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
        - name: PRETRAIN_JOB_KIND  # which API its Events and last-resort suspend speak (app/budget/kube.py)
          value: {{ $tj | ternary "TrainJob" "PyTorchJob" }}
        {{- if $tj }}
        # What the Job controller sets in Indexed mode, named here so the sidecar does not depend on it.
        - name: JOB_COMPLETION_INDEX
          valueFrom:
            fieldRef:
              fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
        {{- end }}
      ports:
        - name: budget-metrics
          containerPort: 9401
          protocol: TCP
      # Training does not start until the guard serves its metrics: no unguarded spend.
      startupProbe:
        {{- if $tj }}
        exec:
          command:
            - python
            - -c
            - |
              import os, urllib.request
              if os.environ.get("JOB_COMPLETION_INDEX", "0") == "0":
                  urllib.request.urlopen("http://127.0.0.1:9401/metrics", timeout=4)
        timeoutSeconds: 5
        {{- else }}
        httpGet:
          path: /metrics
          port: budget-metrics
        {{- end }}
        periodSeconds: 2
        failureThreshold: 60
      resources:
        {{- include "pretrain.smallResources" (dict "ctx" $ "requests" $v.budget.watcher.resources.requests "limits" $v.budget.watcher.resources.limits) | nindent 8 }}
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
        {{- if $watcherApi }}
        - name: kube-api-access
          mountPath: /var/run/secrets/kubernetes.io/serviceaccount
          readOnly: true
        {{- end }}
    {{- end }}
    {{- if $prepare }}
    - name: wait-for-data
      image: {{ include "pretrain.image" $ }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      # `pretrain wait-data` whose every end, unusable arguments and crashes included, is a verdict for the
      # launcher (an initContainer failure would read as the operator's retryable 0xbeef).
      command: ["python", "-m", "app.data.wait"]
      args:
        {{- include "pretrain.waitArgs" (dict "ctx" $ "master" $master) | nindent 8 }}
      env:
        - name: POD_NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
      resources:
        {{- include "pretrain.smallResources" (dict "ctx" $ "requests" (dict "cpu" "10m" "memory" "64Mi") "limits" (dict "memory" "256Mi")) | nindent 8 }}
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
        {{- if $waitApi }}
        - name: kube-api-access
          mountPath: /var/run/secrets/kubernetes.io/serviceaccount
          readOnly: true
        {{- end }}
    {{- end }}
  {{- end }}
  containers:
    - name: {{ $trainer }}
      image: {{ include "pretrain.image" $ }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      # torchrun, keeping the trainer's exit code for the ExitCode restart policy, behind the retry budget
      # and the verdicts of the init steps (app/launch.py, app/restarts.py).
      command: ["python", "-m", "app.launch"]
      args:
        - --nnodes={{ .nodes }}
        - --nproc-per-node={{ .nproc }}
        - --max-restarts=0
        - -m
        {{- if $bench }}
        - app.tools.bench
        {{- include "pretrain.benchArgs" $ | nindent 8 }}
        {{- else }}
        - app.train
        {{- include "pretrain.trainerArgs" $ | nindent 8 }}
        {{- end }}
      env:
        - name: TORCH_ELASTIC_SHUTDOWN_TIMEOUT
          value: {{ max 30 (sub ($v.trainer.terminationGracePeriodSeconds | int) 30) | quote }}
        {{- if not $bench }}
        # The launcher's retry budget (app/restarts.py): kubeflow/trainer#2045, restarts under ExitCode
        # never reach backoffLimit. A new release revision starts a new count.
        - name: PRETRAIN_RUN_DIR
          value: {{ printf "/ckpt/%s" $run | quote }}
        - name: PRETRAIN_MAX_RESTARTS
          value: {{ $v.trainer.maxRestarts | int | quote }}
        - name: PRETRAIN_RESTARTS_EPOCH
          value: {{ $.Release.Revision | quote }}
        {{- end }}
        {{- if $watcher }}
        - name: PRETRAIN_WATCHER_VERDICT
          value: /run/pretrain/watcher-verdict.json
        {{- end }}
        {{- if $prepare }}
        - name: PRETRAIN_DATA_VERDICT
          value: /run/pretrain/data-verdict.json
        {{- end }}
        {{- with $v.trainer.network.socketIfname }}
        - name: NCCL_SOCKET_IFNAME
          value: {{ . | quote }}
        - name: GLOO_SOCKET_IFNAME
          value: {{ . | quote }}
        {{- end }}
        {{- with $v.trainer.network.ncclDebug }}
        - name: NCCL_DEBUG
          value: {{ . | quote }}
        {{- end }}
        {{- if eq $v.trainer.network.fabric "efa" }}
        - name: FI_PROVIDER
          value: efa
        - name: FI_EFA_USE_DEVICE_RDMA
          value: "1"
        {{- else if eq $v.trainer.network.fabric "infiniband" }}
        - name: NCCL_IB_DISABLE
          value: "0"
        {{- end }}
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
      {{- if not (and $tj $bench) }}
      ports:
        {{- if not $tj }}
        - name: pytorchjob-port
          containerPort: 23456
          protocol: TCP
        {{- end }}
        {{- if not $bench }}
        - name: metrics
          containerPort: 9400
          protocol: TCP
        {{- end }}
      {{- end }}
      resources:
        {{- include "pretrain.trainerResources" (dict "ctx" $ "nproc" .nproc) | nindent 8 }}
      # The launcher writes why it ended (retry budget spent, a verdict) here; else the log's tail.
      terminationMessagePolicy: FallbackToLogsOnError
      {{- with (include "pretrain.trainerSecurityContext" $) }}
      securityContext:
        {{- . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: config
          mountPath: /etc/pretrain
          readOnly: true
        {{- if not $bench }}
        - name: data
          mountPath: /data
          readOnly: true
        - name: ckpt
          mountPath: /ckpt
        {{- end }}
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
    {{- if not $bench }}
    - name: data
      persistentVolumeClaim:
        claimName: {{ include "pretrain.dataClaim" $ }}
    - name: ckpt
      persistentVolumeClaim:
        claimName: {{ include "pretrain.ckptClaim" $ }}
    {{- end }}
    - name: run
      emptyDir:
        sizeLimit: 16Mi
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.trainer.shmSizeLimit }}
    {{- if or $watcherApi $waitApi }}
    {{- include "pretrain.kubeApiVolume" $ | nindent 4 }}
    {{- end }}
    {{- with $v.trainer.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* The trainer's security context: containerSecurityContext plus, for this container alone, the
capabilities of trainer.extraCapabilities (and IPC_LOCK for an RDMA fabric: pinned memory). */}}
{{- define "pretrain.trainerSecurityContext" -}}
{{- $v := .Values -}}
{{- $sc := deepCopy (default dict $v.containerSecurityContext) -}}
{{- $add := $v.trainer.extraCapabilities -}}
{{- if has $v.trainer.network.fabric (list "efa" "infiniband") }}{{ $add = append $add "IPC_LOCK" }}{{ end -}}
{{- if $add -}}
{{- $caps := default dict $sc.capabilities -}}
{{- $_ := set $caps "add" (concat (default list $caps.add) $add | uniq) -}}
{{- $_ := set $sc "capabilities" $caps -}}
{{- end -}}
{{- with $sc }}{{ toYaml . }}{{ end -}}
{{- end }}

{{/* Arguments of `python -m app.train` in every trainer pod (and in the `helm test` pod). */}}
{{- define "pretrain.trainerArgs" -}}
{{- $v := .Values -}}
- --config
- /etc/pretrain/config.yaml
- --out
- {{ printf "/ckpt/%s" (include "pretrain.runName" .) | quote }}
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
{{- if gt (include "pretrain.float" $v.budget.pricePerGpuHour | float64) 0.0 }}
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
{{- end }}

{{/* Arguments of `pretrain watch`, the budget-watcher sidecar (and the `helm test` pod's dry run). */}}
{{- define "pretrain.watcherArgs" -}}
{{- $v := .Values -}}
- watch
- --budget-cap-usd
- {{ $v.budget.capUSD | toString | quote }}
- --gpus
- {{ $v.gpus | int | quote }}
{{- with $v.budget.gpuType }}
- --gpu-type
- {{ . | quote }}
{{- end }}
{{- if gt (include "pretrain.float" $v.budget.pricePerGpuHour | float64) 0.0 }}
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
- {{ default (printf "label:%s:%s" (ternary "jobset.sigs.k8s.io/jobset-name" "training.kubeflow.org/job-name" (include "pretrain.trainJob" . | empty | not)) (include "pretrain.fullname" .)) $v.budget.opencostSelector | quote }}
{{- end }}
- --idle-allowance-seconds
- {{ $v.budget.idleAllowanceSeconds | int | quote }}
- --config
- /etc/pretrain/config.yaml
- --run-dir
- {{ printf "/ckpt/%s" (include "pretrain.runName" .) | quote }}
- --stop-file
- /run/pretrain/stop.json
- --metrics-port
- "9401"
# A native sidecar is stopped by the kubelet when the trainer exits; exiting on its own would only
# make the kubelet restart it. One that cannot start leaves its reason here for the launcher (exit 2)
# and keeps serving /metrics, so that the pod does not hang in Init.
- --no-exit-when-done
- --verdict
- /run/pretrain/watcher-verdict.json
- --kube
- {{ include "pretrain.watcherKube" . | empty | ternary "off" "auto" | quote }}
- --job-name
- {{ include "pretrain.fullname" . | quote }}
{{- range $v.budget.watcher.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* Arguments of `python -m app.data.wait`, the wait-for-data step (and the `helm test` pod's
--check-args). Called with (dict "ctx" $ "master" bool): the Master posts the DataNotReady Event. */}}
{{- define "pretrain.waitArgs" -}}
{{- $v := .ctx.Values -}}
- --dir
- {{ printf "/data/%s" $v.prepare.outputDir | quote }}
- --fingerprint
- {{ include "pretrain.prepareFingerprint" .ctx | quote }}
- --job
- {{ include "pretrain.readyJobName" .ctx | quote }}
- --poll
- {{ $v.prepare.wait.pollSeconds | int | quote }}
- --timeout
- {{ $v.prepare.wait.timeoutSeconds | int | quote }}
- --stop-file
- /run/pretrain/stop.json
- --verdict
- /run/pretrain/data-verdict.json
{{- if and .master $v.prepare.wait.useKubernetesApi }}
- --event-job
- {{ include "pretrain.fullname" .ctx | quote }}
{{- end }}
{{- end }}

{{/* The preset of the benchmark: bench.preset, else a --preset of extraTrainArgs, else "" (the config
file's, i.e. config.preset). */}}
{{- define "pretrain.benchPreset" -}}
{{- $preset := "" -}}
{{- $args := .Values.extraTrainArgs -}}
{{- range $i, $a := $args -}}
{{- if and (eq $a "--preset") (lt (add1 $i) (len $args)) }}{{ $preset = index $args (add1 $i) }}{{ end -}}
{{- end -}}
{{- default $preset .Values.bench.preset -}}
{{- end }}

{{/* The `--set key=value` pairs of the benchmark: those of extraTrainArgs, then bench.set (later wins). */}}
{{- define "pretrain.benchSets" -}}
{{- $sets := list -}}
{{- $args := .Values.extraTrainArgs -}}
{{- range $i, $a := $args -}}
{{- if and (eq $a "--set") (lt (add1 $i) (len $args)) }}{{ $sets = append $sets (index $args (add1 $i)) }}{{ end -}}
{{- end -}}
{{- toJson (concat $sets .Values.bench.set) -}}
{{- end }}

{{/* Arguments of `python -m app.tools.bench` in the benchmark pods: the training run's config (the
ConfigMap, the preset, extraTrainArgs' --set pairs) with bench.preset and bench.set on top; the JSON
result goes to the log and to an emptyDir file. */}}
{{- define "pretrain.benchArgs" -}}
{{- $v := .Values -}}
- --config
- /etc/pretrain/config.yaml
{{- with (include "pretrain.benchPreset" .) }}
- --preset
- {{ . | quote }}
{{- end }}
{{- with $v.budget.gpuType }}
# the GPU type's peak FLOPs for MFU (unknown to the table: read from the CUDA device name)
- --gpu-type
- {{ . | quote }}
{{- end }}
{{- range (include "pretrain.benchSets" . | fromJsonArray) }}
- --set
- {{ . | quote }}
{{- end }}
- --steps
- {{ $v.bench.steps | int | quote }}
- --warmup
- {{ $v.bench.warmup | int | quote }}
- --out
- /run/pretrain/bench.json
{{- end }}

{{/* What automountServiceAccountToken would mount, for the containers that use the API only. */}}
{{- define "pretrain.kubeApiVolume" -}}
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
