{{/*
Kubeflow Trainer v2 objects: our own namespaced TrainingRuntime (a JobSet template: one replicated Job
`node` with numNodes pods of the project's pod template) and the TrainJob that runs it. Called with
(dict "ctx" $ "name" NAME "bench" bool). Failure semantics are the JobSet's and the Jobs' own
(docs/kubernetes.md, "Failure semantics per operator"):
- exit 2-7 (bad config or data, diverged, no data, retry budget spent, checkpoint volume full, MFU floor): the
  Job's podFailurePolicy FailJob, then the JobSet rule FailJobSet on reason PodFailurePolicy;
- a disruption (pod condition DisruptionTarget: preemption, drain, eviction, a lost node's pods) and
  the retryable exits 130, 142, 143, 144, 145: Ignore, the pod is recreated, nothing counts;
- any other end (a crash: 1, 134, 137, 139...): counted; backoffLimit 0 fails the Job, and the JobSet
  restarts the whole gang, at most trainer.maxRestarts times.
The benchmark (bench true) is retried never: any failure fails the JobSet (a failure is a finding).
*/}}
{{- define "pretrain.trainJobObjects" -}}
{{- $ := .ctx }}
{{- $v := $.Values }}
{{- $bench := .bench | default false }}
{{- $component := $bench | ternary "bench" "trainer" }}
{{- $nodes := include "pretrain.nodes" $ | int }}
{{- $nproc := include "pretrain.nprocPerNode" $ | int }}
# A pre-install/pre-upgrade hook: the Trainer's TrainJob webhook refuses a TrainJob whose runtime does not
# exist yet, and Helm would create the TrainJob first (unknown kinds go in alphabetical order).
apiVersion: trainer.kubeflow.org/v1alpha1
kind: TrainingRuntime
metadata:
  name: {{ .name }}
  labels:
    {{- include "pretrain.selectorLabels" $ | nindent 4 }}
    app.kubernetes.io/managed-by: {{ $.Release.Service }}
    app.kubernetes.io/part-of: pretrain
    app.kubernetes.io/component: {{ $component }}
    trainer.kubeflow.org/framework: torch
    {{- with $v.commonLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    helm.sh/hook: pre-install,pre-upgrade
    helm.sh/hook-weight: "-5"
    helm.sh/hook-delete-policy: before-hook-creation
    {{- with (include "pretrain.annotations" $) }}
    {{- . | nindent 4 }}
    {{- end }}
spec:
  mlPolicy:
    numNodes: {{ $nodes }}
    torch: {}
  template:
    spec:
      {{- if $bench }}
      # Nothing is retried: a failing benchmark is a finding. The JobSet and its pods stay for
      # `kubectl logs` until `helm uninstall`.
      failurePolicy:
        maxRestarts: 0
        rules:
          - name: NoRetry
            action: FailJobSet
      {{- else }}
      failurePolicy:
        # Gang restarts after a counted failure (a crash); exits 2-7 fail at once, disruptions and the
        # retryable exits never reach the JobSet (Ignore below).
        maxRestarts: {{ $v.trainer.maxRestarts | int }}
        restartStrategy: Recreate
        rules:
          - name: PermanentExitCode
            action: FailJobSet
            onJobFailureReasons: [PodFailurePolicy]
          - name: Crash
            action: RestartJobSet
            onJobFailureReasons: [BackoffLimitExceeded]
      {{- if not (kindIs "invalid" $v.job.ttlSecondsAfterFinished) }}
      ttlSecondsAfterFinished: {{ $v.job.ttlSecondsAfterFinished | int }}
      {{- end }}
      {{- end }}
      replicatedJobs:
        - name: node
          replicas: 1
          template:
            metadata:
              labels:
                trainer.kubeflow.org/trainjob-ancestor-step: trainer
            spec:
              completionMode: Indexed
              # One counted pod failure fails the Job{{ if not $bench }}, and the JobSet restarts every node together{{ end }}.
              backoffLimit: 0
              {{- if not $bench }}
              # A replacement pod starts once the old one has ended (its checkpoint save included).
              podReplacementPolicy: Failed
              podFailurePolicy:
                rules:
                  # A disruption is never the run's fault, whatever the trainer's exit code then.
                  - action: Ignore
                    onPodConditions:
                      - type: DisruptionTarget
                        status: "True"
                  - action: FailJob
                    onExitCodes:
                      containerName: node
                      operator: In
                      values: [2, 3, 4, 5, 6, 7]
                  # SIGINT/SIGTERM after a checkpoint, the run dir's lease held elsewhere, a lost peer, out of memory with a smaller micro-batch recorded for the restart.
                  - action: Ignore
                    onExitCodes:
                      containerName: node
                      operator: In
                      values: [130, 142, 143, 144, 145]
              {{- end }}
              template:
                {{- include "pretrain.podTemplate" (dict "ctx" $ "replica" "node" "launcher" "trainjob" "nodes" $nodes "nproc" $nproc "bench" $bench) | trim | nindent 16 }}
---
apiVersion: trainer.kubeflow.org/v1alpha1
kind: TrainJob
metadata:
  name: {{ .name }}
  labels:
    {{- include "pretrain.labels" $ | nindent 4 }}
    app.kubernetes.io/component: {{ $component }}
    {{- if and $v.job.kueueQueueName (or $bench (not $v.prepare.enabled)) }}
    {{- /* with prepare.enabled the prepare side adds the label when the data is ready */}}
    kueue.x-k8s.io/queue-name: {{ $v.job.kueueQueueName | quote }}
    {{- end }}
  annotations:
    pretrain/topology: {{ include "pretrain.topologyLabel" $ | quote }}
    {{- with (include "pretrain.annotations" $) }}
    {{- . | nindent 4 }}
    {{- end }}
spec:
  {{- if and $v.prepare.enabled (not $bench) }}
  # No pod (no GPU) until the prepare side has written the data and releases the job
  # (app/data/prepare_job.py); under Kueue it adds the queue label instead and Kueue unsuspends it.
  suspend: true
  {{- end }}
  runtimeRef:
    apiGroup: trainer.kubeflow.org
    kind: TrainingRuntime
    name: {{ .name }}
  trainer:
    # The torch plugin sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and
    # PET_MASTER_PORT in the `node` container from these (the launcher also gets --nnodes/--nproc-per-node).
    numNodes: {{ $nodes }}
    numProcPerNode: {{ $nproc }}
  {{- $deadline := $bench | ternary $v.bench.activeDeadlineSeconds $v.job.activeDeadlineSeconds }}
  {{- if not (kindIs "invalid" $deadline) }}
  activeDeadlineSeconds: {{ $deadline | int }}
  {{- end }}
{{- end }}
