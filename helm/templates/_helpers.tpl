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

{{/* The benchmark PyTorchJob (bench.enabled): <fullname>-bench, short enough for its pods' names. */}}
{{- define "pretrain.benchName" -}}
{{- printf "%s-bench" (include "pretrain.fullname" . | trunc 44 | trimSuffix "-") }}
{{- end }}

{{/* Does the release run training (the PyTorchJob, its volumes, prepare, watcher)? "" with bench.enabled. */}}
{{- define "pretrain.training" -}}
{{- if not .Values.bench.enabled }}true{{ end }}
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

{{/* Does the watcher act on the job through the API (Events, suspend)? Its actions speak PyTorchJob and
TrainJob (app/budget/kube.py, told which by PRETRAIN_JOB_KIND). "true" or "". */}}
{{- define "pretrain.watcherKube" -}}
{{- if .Values.budget.watcher.kubernetesActions }}true{{ end -}}
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


{{/* A number given as a number or as a numeric string (`--set x=2.49` makes a string): as float64. */}}
{{- define "pretrain.float" -}}
{{- . | toString | float64 -}}
{{- end }}

{{/* Name of the prepare Job (with prepare.parallelism > 1 the Indexed Job of the shares): per hash of its
pod template, so a `helm upgrade` that changes the template (image, arguments, resources) creates a new Job
(Helm deletes the old one) instead of failing on the immutable spec.template of the existing one; and of
pretrain.prepareNonce. <= 58 characters: an Indexed Job's pods are named <job>-<index>. */}}
{{- define "pretrain.prepareJobName" -}}
{{- $hash := printf "%s%s" (include "pretrain.prepareTemplate" (dict "ctx" . "role" "prepare")) (include "pretrain.prepareNonce" .) | sha256sum | trunc 8 -}}
{{- printf "%s-prepare-%s" (include "pretrain.fullname" . | trunc 41 | trimSuffix "-") $hash -}}
{{- end }}

{{/* The finalizer Job (pretrain.prepareFinalizer): waits for the prepare (with prepare.parallelism > 1 joins
the shares and writes _READY) and releases the training job. */}}
{{- define "pretrain.finalizerJobName" -}}
{{- $hash := printf "%s%s" (include "pretrain.prepareTemplate" (dict "ctx" . "role" "finalizer")) (include "pretrain.prepareNonce" .) | sha256sum | trunc 8 -}}
{{- printf "%s-finalize-%s" (include "pretrain.fullname" . | trunc 44 | trimSuffix "-") $hash -}}
{{- end }}

{{/* The Job that writes the _READY marker, which the trainer's wait step watches. */}}
{{- define "pretrain.readyJobName" -}}
{{- if gt (int .Values.prepare.parallelism) 1 }}{{ include "pretrain.finalizerJobName" . }}{{ else }}{{ include "pretrain.prepareJobName" . }}{{ end -}}
{{- end }}

{{/* The training job is created suspended, and only a prepare pod releases it. A Job that already ran
(Complete) runs no pod again, so an upgrade that (re)creates the training job (the user deleted it, as
"Upgrades" in docs/kubernetes.md says to) must also create new prepare Jobs: their names then carry the
revision, and the new pods find the marker and release the job within seconds. "" otherwise (an install, an
upgrade of a live job, `helm template`), which keeps the names and a running prepare. */}}
{{- define "pretrain.prepareNonce" -}}
{{- if and .Release.IsUpgrade .Values.job.enabled (include "pretrain.training" .) -}}
{{- $api := include "pretrain.trainJob" . | empty | ternary "kubeflow.org/v1" "trainer.kubeflow.org/v1alpha1" -}}
{{- $kind := include "pretrain.trainJob" . | empty | ternary "PyTorchJob" "TrainJob" -}}
{{- if and (.Capabilities.APIVersions.Has $api) (not (lookup $api $kind .Release.Namespace (include "pretrain.fullname" .))) -}}
revision-{{ .Release.Revision }}
{{- end -}}
{{- end -}}
{{- end }}

{{/* The prepare pods' ServiceAccount: its own (only the prepare's Role is bound to it), or the given one. */}}
{{- define "pretrain.prepareServiceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- printf "%s-prepare" (include "pretrain.fullname" .) }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* "auto" volume permissions: on when a volume may be ReadWriteMany (an existing claim, or RWX). */}}
{{- define "pretrain.volumePermissions" -}}
{{- $v := .Values.volumePermissions.enabled -}}
{{- if kindIs "bool" $v -}}
{{- if $v }}true{{ end -}}
{{- else -}}
{{- range $s := list .Values.storage.data .Values.storage.checkpoints -}}
{{- if or $s.existingClaim (has "ReadWriteMany" $s.accessModes) }}true{{ end -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/* The root init step that hands the given mount points to runAsUser:runAsGroup (not recursive). It never
fails the pod (an initContainer failure reads as the retryable 0xbeef to the operator): it says what it
could not do, and the launcher or the prepare script then fails with one line. */}}
{{- define "pretrain.volumePermissionsContainer" -}}
{{- $v := .ctx.Values -}}
{{- $uid := int (default 1000 $v.podSecurityContext.runAsUser) -}}
{{- $gid := int (default $uid (default $v.podSecurityContext.runAsGroup $v.podSecurityContext.fsGroup)) -}}
- name: volume-permissions
  image: {{ include "pretrain.image" .ctx }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command:
    - sh
    - -c
    - |
      for d in "$@"; do
        if mkdir -p "$d" && chown "$OWNER" "$d" && chmod u+rwx,g+rwxs "$d"; then
          echo "volume-permissions: $d -> $OWNER, mode $(stat -c %a "$d")"
        else
          echo "volume-permissions: cannot hand $d to $OWNER (an NFS export with root_squash?); give the volume's root to uid ${OWNER%%:*} on the server, or use an access point / StorageClass with that uid and gid" >&2
        fi
      done
    - volume-permissions
  args:
    {{- range .dirs }}
    - {{ . | quote }}
    {{- end }}
  env:
    - name: OWNER
      value: {{ printf "%d:%d" $uid $gid | quote }}
  resources:
    {{- include "pretrain.smallResources" (dict "ctx" .ctx "requests" (dict "cpu" "10m" "memory" "16Mi") "limits" (dict "memory" "64Mi")) | nindent 4 }}
  securityContext:
    # Root only to chown the mount points; no other privilege.
    runAsUser: 0
    runAsGroup: 0
    runAsNonRoot: false
    allowPrivilegeEscalation: false
    capabilities:
      drop: ["ALL"]
      add: ["CHOWN", "FOWNER", "DAC_OVERRIDE"]
  volumeMounts:
    {{- toYaml .mounts | nindent 4 }}
{{- end }}

{{/* Resources of a small helper container: as given, or with limits = requests (cpu and memory, the larger
one where both are set) under trainer.qos=Guaranteed, which every container of a pod must meet. */}}
{{- define "pretrain.smallResources" -}}
{{- $out := dict "requests" (deepCopy .requests) "limits" (deepCopy (default dict .limits)) -}}
{{- if eq .ctx.Values.trainer.qos "Guaranteed" -}}
{{- $out = include "pretrain.guaranteed" $out | fromYaml -}}
{{- end -}}
{{- toYaml $out -}}
{{- end }}

{{/* limits = requests for cpu and memory: the limit where one is set, else the request. */}}
{{- define "pretrain.guaranteed" -}}
{{- $req := default dict .requests -}}
{{- $lim := default dict .limits -}}
{{- range $k := list "cpu" "memory" -}}
{{- $val := default (index $req $k | default "") (index $lim $k | default "") -}}
{{- if $val -}}
{{- $_ := set $req $k $val -}}
{{- $_ := set $lim $k $val -}}
{{- end -}}
{{- end -}}
{{- toYaml (dict "requests" $req "limits" $lim) -}}
{{- end }}

{{/* Resources of the trainer container: trainer.resources when given, else trainer.resourcesPerGpu x GPUs
per pod; plus the GPUs and trainer.network.fabricResources in requests and limits; trainer.qos. */}}
{{- define "pretrain.trainerResources" -}}
{{- $v := .ctx.Values -}}
{{- $n := int .nproc -}}
{{- $res := dict -}}
{{- if $v.trainer.resources -}}
{{- $res = deepCopy $v.trainer.resources -}}
{{- else -}}
{{- $per := $v.trainer.resourcesPerGpu -}}
{{- $milli := int (mulf (include "pretrain.float" $per.cpu | float64) 1000.0 (float64 $n)) -}}
{{- $cpu := eq (mod $milli 1000) 0 | ternary (printf "%d" (div $milli 1000)) (printf "%dm" $milli) -}}
{{- $req := dict "cpu" $cpu "memory" (printf "%dGi" (mul (int $per.memoryGiB) $n)) -}}
{{- $lim := dict -}}
{{- if $per.memoryLimitGiB }}{{ $_ := set $lim "memory" (printf "%dGi" (mul (int $per.memoryLimitGiB) $n)) }}{{ end -}}
{{- $res = dict "requests" $req "limits" $lim -}}
{{- end -}}
{{- if eq $v.trainer.qos "Guaranteed" -}}
{{- $res = include "pretrain.guaranteed" $res | fromYaml -}}
{{- end -}}
{{- $limits := default dict $res.limits -}}
{{- $requests := default dict $res.requests -}}
{{- $_ := set $limits $v.gpuResource $n -}}
{{- $_ := set $requests $v.gpuResource $n -}}
{{- range $k, $q := $v.trainer.network.fabricResources -}}
{{- $_ := set $limits $k $q -}}
{{- $_ := set $requests $k $q -}}
{{- end -}}
{{- $_ := set $res "limits" $limits -}}
{{- $_ := set $res "requests" $requests -}}
{{- toYaml $res -}}
{{- end }}

{{/* The preset's batch must split over the GPUs (the trainer's rule: train.batch_tokens a multiple of
micro_batch_size x seq_len x world size; with micro_batch_size auto, of seq_len x world size); checked here, before any pod is scheduled. The preset table is
generated from app/presets by scripts/chart_presets.py. Presets the table does not know are left to the
trainer. */}}
{{- define "pretrain.checkBatch" -}}
{{- $table := .Files.Get "presets.yaml" | fromYaml -}}
{{- $cfg := .Values.config -}}
{{- $preset := default $table.default $cfg.preset -}}
{{- $sets := dict -}}
{{- $args := .Values.extraTrainArgs -}}
{{- range $i, $a := $args -}}
{{- if and (eq $a "--set") (lt (add1 $i) (len $args)) -}}
{{- $kv := splitn "=" 2 (index $args (add1 $i)) -}}
{{- $_ := set $sets (trim $kv._0) (trim (default "" $kv._1)) -}}
{{- else if and (eq $a "--preset") (lt (add1 $i) (len $args)) -}}
{{- $preset = index $args (add1 $i) -}}
{{- end -}}
{{- end -}}
{{- if .Values.bench.enabled -}}
{{- $preset = default $preset .Values.bench.preset -}}
{{- range .Values.bench.set -}}
{{- $kv := splitn "=" 2 . -}}
{{- $_ := set $sets (trim $kv._0) (trim (default "" $kv._1)) -}}
{{- end -}}
{{- end -}}
{{- $base := index $table.presets $preset -}}
{{- if $base -}}
{{- $train := default dict $cfg.train -}}
{{- $model := default dict $cfg.model -}}
{{- $batch := int (index $sets "train.batch_tokens" | default (dig "batch_tokens" $base.batch_tokens $train)) -}}
{{- $microSet := index $sets "train.micro_batch_size" | default (dig "micro_batch_size" $base.micro_batch_size $train) -}}
{{- $auto := eq (toString $microSet) "auto" -}}{{/* auto picks a divisor: the batch must split into seq_len x GPUs */}}
{{- $micro := $auto | ternary 1 (int $microSet) -}}
{{- $seq := int (index $sets "model.seq_len" | default (dig "seq_len" $base.seq_len $model)) -}}
{{- $gpus := int .Values.gpus -}}
{{- $per := mul $micro $seq -}}
{{- if and (gt $batch 0) (gt $per 0) (ne (mod $batch (mul $per $gpus)) 0) -}}
{{- $ok := list -}}
{{- range $n := untilStep 1 513 1 -}}
{{- if eq (mod $batch (mul $per $n)) 0 }}{{ $ok = append $ok (toString $n) }}{{ end -}}
{{- end -}}
{{- fail (printf "gpus=%d: the %s preset's global batch (train.batch_tokens=%d) does not split into micro_batch_size %s x seq_len %d x %d GPUs, so the %s would exit 2 after the pods were scheduled; it splits over %s GPUs. Use one of those, or set config.train.batch_tokens to a multiple of %d (or another config.train.micro_batch_size)" $gpus $preset $batch ($auto | ternary "auto (a divisor)" (toString $micro)) $seq $gpus (.Values.bench.enabled | ternary "benchmark" "trainer") (join ", " $ok) (mul $per $gpus)) -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/* Every render-time refusal, in one place (called from configmap.yaml, which always renders). */}}
{{- define "pretrain.validate" -}}
{{- $_ := include "pretrain.topology" . -}}
{{- $v := .Values -}}
{{- $name := include "pretrain.fullname" . -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) -}}
{{- fail (printf "the object name %q must start with a letter (the training-operator checks PyTorchJob names as DNS-1035 labels): use a release name that starts with a letter, or set fullnameOverride" $name) -}}
{{- end -}}
{{- if and $v.job.enabled (include "pretrain.training" .) (gt (int (include "pretrain.nodes" .)) 1) -}}
{{- range $key, $s := dict "data" $v.storage.data "checkpoints" $v.storage.checkpoints -}}
{{- if and (not $s.existingClaim) (not (has "ReadWriteMany" $s.accessModes)) -}}
{{- fail (printf "gpus=%d runs %s pods on different nodes, but storage.%s.accessModes=%v cannot be mounted by more than one node: the Worker pods would stay in ContainerCreating (Multi-Attach error). Use [ReadWriteMany] with a StorageClass that supports it (storage.%s.storageClass), or gpus <= gpusPerNode" (int $v.gpus) (include "pretrain.nodes" $) $key $s.accessModes $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $d := $v.storage.data -}}
{{- if and $v.prepare.enabled (include "pretrain.training" .) (gt (int $v.prepare.parallelism) 1) (not $d.existingClaim) (not (has "ReadWriteMany" $d.accessModes)) -}}
{{- fail (printf "prepare.parallelism=%d runs that many prepare pods, on different nodes, but storage.data.accessModes=%v cannot be mounted by more than one node: they would hang on Multi-Attach. Use [ReadWriteMany] for storage.data (with a StorageClass that supports it), or prepare.parallelism=1" (int $v.prepare.parallelism) $d.accessModes) -}}
{{- end -}}
{{- if and (not $v.serviceAccount.create) (not $v.serviceAccount.name) $v.rbac.create (or (include "pretrain.rbacNeeded" .) (include "pretrain.prepareFinalizer" .)) -}}
{{- fail "serviceAccount.create=false without serviceAccount.name: the watcher's and the prepare's Roles would be bound to the namespace's `default` ServiceAccount, which every other pod there uses. Set serviceAccount.name to an existing ServiceAccount, or rbac.create=false (and grant it yourself)" -}}
{{- end -}}
{{- if and $v.bench.enabled $v.serve.enabled -}}
{{- fail "bench.enabled and serve.enabled are both true: a benchmark release renders the benchmark job alone (no volumes, no training), so there is nothing to serve. Install the benchmark as its own release: helm install bench ./helm --set gpus=N --set bench.enabled=true" -}}
{{- end -}}
{{- if and $v.metrics.podMonitor.enabled $v.metrics.serviceMonitor.enabled -}}
{{- fail "metrics.podMonitor.enabled and metrics.serviceMonitor.enabled are both true: Prometheus would scrape every pod twice and the alert rules would see every series twice. Enable one" -}}
{{- end -}}
{{- $vf := include "pretrain.float" $v.prepare.valFraction | float64 -}}
{{- if or (le $vf 0.0) (ge $vf 1.0) -}}
{{- fail (printf "prepare.valFraction=%v must be between 0 and 1 (exclusive)" $v.prepare.valFraction) -}}
{{- end -}}
{{- include "pretrain.checkBatch" . -}}
{{- include "pretrain.validateExport" . -}}
{{- include "pretrain.upgradeGuard" . -}}
{{- end }}

{{/* Is a Role needed: the watcher's Kubernetes actions, or the wait step reading the prepare Job. */}}
{{- define "pretrain.rbacNeeded" -}}
{{- if and .Values.job.enabled (include "pretrain.training" .) -}}
{{- if and (include "pretrain.watcherEnabled" .) (include "pretrain.watcherKube" .) }}true{{ end -}}
{{- if and .Values.prepare.enabled .Values.prepare.wait.useKubernetesApi }}true{{ end -}}
{{- end -}}
{{- end }}

{{/* Is there a finalizer Job: to release the training job (the prepare pods, which parse downloads, hold
no API token), or to join the shares of a sharded prepare. It alone of the prepare side uses the API (and
reads the prepare Job): its Role exists with it. */}}
{{- define "pretrain.prepareFinalizer" -}}
{{- if and .Values.prepare.enabled (include "pretrain.training" .) -}}
{{- if or .Values.job.enabled (gt (int .Values.prepare.parallelism) 1) }}true{{ end -}}
{{- end -}}
{{- end }}

{{/* `helm upgrade` with another shape (gpus, gpusPerNode) over a PyTorchJob that still runs: the operator
never replaces running pods, so new Workers with the new --nnodes would wait forever beside the old
Master. Refused with the commands that apply it. (`lookup` is empty in `helm template`.) */}}
{{- define "pretrain.upgradeGuard" -}}
{{- /* A cluster without the v1 operator (Trainer v2 only) has no PyTorchJob to look up: Helm's lookup of an
unserved API fails the install instead of answering empty. */ -}}
{{- if and (or .Values.job.enabled .Values.bench.enabled) (.Capabilities.APIVersions.Has "kubeflow.org/v1") -}}
{{- $name := include "pretrain.fullname" . -}}
{{- $old := lookup "kubeflow.org/v1" "PyTorchJob" .Release.Namespace $name -}}
{{- if $old -}}
{{- $was := dig "metadata" "annotations" "pretrain/topology" "" $old -}}
{{- $now := include "pretrain.topologyLabel" . -}}
{{- $finished := false -}}
{{- range (dig "status" "conditions" list $old) -}}
{{- if and (has .type (list "Succeeded" "Failed")) (eq (toString .status) "True") }}{{ $finished = true }}{{ end -}}
{{- end -}}
{{- if and .Values.bench.enabled (not $finished) -}}
{{- fail (printf "bench.enabled=true on release %s, whose training PyTorchJob %s still runs: this upgrade would delete it (a benchmark release renders the benchmark alone). Install the benchmark as its own release instead: helm install bench ./helm --set gpus=%d --set bench.enabled=true" .Release.Name $name (int .Values.gpus)) -}}
{{- end -}}
{{- if and $was (ne $was $now) (not $finished) -}}
{{- fail (printf "this upgrade changes the running PyTorchJob %s from %s to %s (nodes x GPUs): the training-operator never replaces running pods, so new Workers would wait forever beside the old Master. Apply it with `kubectl -n %s delete pytorchjob %s` (the pods checkpoint on SIGTERM), then run this helm upgrade again: the new job resumes from /ckpt/%s" $name $was $now .Release.Namespace $name (include "pretrain.runName" .)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/* The training job's kind: "trainjob" (Kubeflow Trainer v2: TrainJob + TrainingRuntime, run by JobSet) or
"pytorchjob" (Training Operator v1). scheduler=auto picks TrainJob when the cluster serves
trainer.kubeflow.org/v1alpha1 (`helm template`: --api-versions), else PyTorchJob. */}}
{{- define "pretrain.scheduler" -}}
{{- $s := .Values.scheduler | default "auto" -}}
{{- if eq $s "auto" -}}
{{- .Capabilities.APIVersions.Has "trainer.kubeflow.org/v1alpha1" | ternary "trainjob" "pytorchjob" -}}
{{- else -}}
{{- $s -}}
{{- end -}}
{{- end }}

{{/* "true" when the training job is a TrainJob, else "". */}}
{{- define "pretrain.trainJob" -}}
{{- if eq (include "pretrain.scheduler" .) "trainjob" }}true{{ end -}}
{{- end }}

{{- define "pretrain.topologyLabel" -}}
{{- printf "%sx%s" (include "pretrain.nodes" .) (include "pretrain.nprocPerNode" .) -}}
{{- end }}
