"""TorchX components: the trainer (`train`) and data preparation (`prepare`); usage and how this path
differs from the Helm chart (Volcano, the in-process budget guard): docs/kubernetes.md ("With TorchX").
On a laptop, without volumes:

    torchx run -s local_cwd app/components.py:train --gpus 0 --nproc 2 --data_pvc "" --ckpt_pvc "" \
        --out runs/torchx -- --preset tiny --max-steps 20

The signatures use typing.Optional/List/Dict on purpose: TorchX 0.7 builds the CLI of a component from
its annotations and understands only those forms.
"""

from typing import Dict, List, Optional  # noqa: UP035

import torchx.specs as specs
from torchx.components import dist

DEFAULT_IMAGE = "pretrain:0.1.0"


def _mounts(data_pvc: str, ckpt_pvc: str, data_readonly: bool) -> List[str]:  # noqa: UP006
    mounts: List[str] = []  # noqa: UP006
    if data_pvc:
        mounts += ["type=volume", f"src={data_pvc}", "dst=/data"] + (["readonly"] if data_readonly else [])
    if ckpt_pvc:
        mounts += ["type=volume", f"src={ckpt_pvc}", "dst=/ckpt"]
    return mounts


def train(
    *script_args: str,
    image: str = DEFAULT_IMAGE,
    gpus: int = 8,
    gpus_per_node: int = 8,
    nproc: int = 0,
    preset: str = "x1-50m",
    config: Optional[str] = None,  # noqa: UP045
    out: str = "/ckpt/torchx-pretrain",
    data: str = "/data/fineweb-edu-10bt",
    budget_cap_usd: float = 0.0,
    price_per_gpu_hour: float = 0.0,
    gpu_type: str = "",
    metrics_port: int = 9400,
    data_pvc: str = "pretrain-data",
    ckpt_pvc: str = "pretrain-ckpt",
    cpu: int = 32,
    memMB: int = 262144,
    h: Optional[str] = None,  # noqa: UP045
    env: Optional[Dict[str, str]] = None,  # noqa: UP006, UP045
    max_retries: int = 3,
    name: str = "pretrain",
) -> specs.AppDef:
    """Train with torchrun on `gpus` GPUs (nodes = gpus / gpus_per_node) through TorchX.

    Args:
        script_args: extra arguments of `python -m app.train` (after --), e.g. --max-steps 100
        image: the image built from the repository's Dockerfile
        gpus: total GPUs; a multiple of gpus_per_node, or fewer (one node); 0 = CPU processes
        gpus_per_node: GPUs per node of the GPU pool
        nproc: processes per node when gpus is 0 (CPU runs); ignored otherwise
        preset: trainer preset (--preset); ignored when config is given
        config: a trainer config YAML inside the image or on a volume (--config)
        out: run directory (--out), on the checkpoint volume
        data: dataset directory written by `pretrain prepare` (data.dataset); "" keeps the config's
        budget_cap_usd: spend cap in USD guarded in-process by rank 0 (0 = no guard)
        price_per_gpu_hour: USD per GPU-hour (0 = the price table of gpu_type)
        gpu_type: GPU type key of the price table (budget.gpu_type)
        metrics_port: trainer Prometheus port (0 = off)
        data_pvc: PVC mounted read-only at /data ("" = none)
        ckpt_pvc: PVC mounted at /ckpt ("" = none)
        cpu: CPUs per node
        memMB: memory per node in MB
        h: a registered TorchX named resource (wins over cpu, gpus and memMB)
        env: extra environment variables
        max_retries: whole-job restarts by the scheduler (preemption resumes from the last checkpoint)
        name: job name
    """
    if gpus < 0:
        raise ValueError(f"gpus={gpus}: must be >= 0")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        lo = gpus // gpus_per_node * gpus_per_node
        raise ValueError(
            f"gpus={gpus} is not a multiple of gpus_per_node={gpus_per_node}: use {lo} or {lo + gpus_per_node}"
        )
    # fewer GPUs than a node has: one node; none: CPU processes on one node
    nnodes, per_node = (
        (max(gpus // gpus_per_node, 1), min(gpus, gpus_per_node)) if gpus else (1, max(nproc, 1))
    )
    args = ["--config", config] if config else ["--preset", preset]
    args += ["--out", out, "--metrics-port", str(metrics_port)]
    if data:
        args += ["--set", f"data.dataset={data}"]
    if budget_cap_usd > 0:
        args += ["--budget-cap-usd", str(budget_cap_usd), "--set", "budget.in_process=true"]
        if price_per_gpu_hour > 0:
            args += ["--price-per-gpu-hour", str(price_per_gpu_hour)]
        if gpu_type:
            args += ["--set", f"budget.gpu_type={gpu_type}"]
        if gpus:
            args += ["--gpus", str(gpus)]
    return dist.ddp(
        *args,
        *script_args,
        m="app.train",
        image=image,
        name=name,
        h=h,
        cpu=cpu,
        gpu=per_node if gpus else 0,
        memMB=memMB,
        j=f"{nnodes}x{per_node}",
        env=env,
        max_retries=max_retries,
        mounts=_mounts(data_pvc, ckpt_pvc, data_readonly=True) or None,
    )


def prepare(
    *extra_args: str,
    input: str = "hf://datasets/HuggingFaceFW/fineweb-edu?include=sample/10BT/*.parquet",
    out: str = "/data/fineweb-edu-10bt",
    image: str = DEFAULT_IMAGE,
    text_column: str = "text",
    tokenizer: str = "",
    vocab_size: int = 50257,
    val_fraction: float = 0.001,
    workers: int = 0,
    data_pvc: str = "pretrain-data",
    cpu: int = 16,
    memMB: int = 65536,
    env: Optional[Dict[str, str]] = None,  # noqa: UP006, UP045
    max_retries: int = 2,
    name: str = "pretrain-prepare",
) -> specs.AppDef:
    """Tokenize a dataset into token shards on a CPU node (`pretrain prepare`).

    Run it to completion (`--wait`) before `train`: TorchX has no cross-job ordering.

    Args:
        extra_args: extra arguments of `pretrain prepare` (after --)
        input: a path on the data volume or hf://datasets/REPO[?include=GLOB]
        out: output directory (on the data volume)
        image: the image built from the repository's Dockerfile
        text_column: text column of parquet/jsonl input
        tokenizer: tokenizer.json path, hub tokenizer or `char`; "" = train a BPE of vocab_size
        vocab_size: vocabulary of the trained BPE
        val_fraction: share held out for validation
        workers: tokenizer processes (0 = all cores)
        data_pvc: PVC mounted at /data ("" = none, e.g. local runs)
        cpu: CPUs
        memMB: memory in MB
        env: extra environment variables (HF_TOKEN of a gated dataset: prefer the chart's prepare Job)
        max_retries: scheduler retries (prepare resumes where it stopped)
        name: job name
    """
    args = ["prepare", "--input", input, "--out", out, "--text-column", text_column]
    args += ["--tokenizer", tokenizer] if tokenizer else ["--vocab-size", str(vocab_size)]
    args += ["--val-fraction", str(val_fraction)]
    if workers > 0:
        args += ["--workers", str(workers)]
    mounts = _mounts(data_pvc, "", data_readonly=False)
    return specs.AppDef(
        name=name,
        roles=[
            specs.Role(
                name="prepare",
                image=image,
                entrypoint="pretrain",
                args=[*args, *extra_args],
                env=dict(env or {}),
                resource=specs.resource(cpu=cpu, gpu=0, memMB=memMB),
                max_retries=max_retries,
                mounts=specs.parse_mounts(mounts) if mounts else [],
            )
        ],
    )
