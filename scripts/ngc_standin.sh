#!/usr/bin/env bash
# A registry-free stand-in for the NGC PyTorch base image, for `make image-smoke` on machines that
# cannot pull nvcr.io. It has what the Dockerfile relies on in the real image:
#   - a system Python with pip (not "externally managed") and `python` on PATH,
#   - torch installed into that Python (here the CPU wheel `pip install torch==2.13.0` resolves to),
#   - /etc/pip/constraint.txt pinning every installed package, with PIP_CONSTRAINT pointing at it
#     (NGC images have done this since 25.03),
#   - a uid-1000 user (`ubuntu` in the Ubuntu 24.04 based NGC images).
# Plus this machine's extra CA certificates, so that pip inside the build can reach PyPI through a
# TLS-inspecting egress.
#
# Where it differs from the base it stands in for (app/trainer/features.py, BASE; `--versions` prints both):
#   - Python: Debian bookworm's 3.11 where the base has 3.12. No Debian release ships 3.12 (bookworm 3.11,
#     trixie 3.13), and nothing but Debian and PyPI can be reached here.
#   - torch: the CPU wheel of TORCH_SPEC, not the base's minor. PyPI's torch of that minor is the CUDA
#     build, which pins nvidia-* CUDA wheels (several GB; this index lacks some), and the CPU builds live
#     on PyTorch's own index. tests/test_dockerfile.py checks instead that the base's torch has every
#     feature the code uses, and the image build runs the same check against the real base.
#
#   DOCKER="docker -H unix:///path/docker.sock" scripts/ngc_standin.sh TAG WORKDIR
#   scripts/ngc_standin.sh --versions
#
# Needs root, debootstrap and network access to a Debian mirror and to the pip index.
set -euo pipefail

DOCKER=${DOCKER:-docker}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
SUITE=bookworm
SUITE_PYTHON=3.11
repo=$(cd "$(dirname "$0")/.." && pwd)
read -r base_image base_torch base_cuda base_python < <(
  python3 -c "import sys; sys.path.insert(0, sys.argv[1]); from app.trainer.features import BASE as b
print(b['image'], b['torch'], b['cuda'], b['python'])" "$repo"
)
if [[ ${1:-} == --versions ]]; then
  echo "base: $base_image (torch $base_torch, CUDA $base_cuda, Python $base_python)"
  echo "stand-in: Debian $SUITE (Python $SUITE_PYTHON), $TORCH_SPEC CPU wheel"
  exit 0
fi
[[ $base_python == "$SUITE_PYTHON" ]] ||
  echo "ngc-standin: Python $SUITE_PYTHON where $base_image has $base_python (no Debian release ships it)"

tag=${1:?usage: ngc_standin.sh TAG WORKDIR}
work=${2:?usage: ngc_standin.sh TAG WORKDIR}

# The mirror this machine's apt uses (deb822 or one-line sources), else the public one.
mirror=${DEBIAN_MIRROR:-$(
  cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
    grep -oE '(https?|file)://[^ ]*/debian/?( |$)' | grep -v security | head -n1 | tr -d ' ' || true
)}
mirror=${mirror:-http://deb.debian.org/debian}

root="$work/rootfs"
wheels="$work/wheels"
rm -rf "$root"
mkdir -p "$root" "$wheels"

echo "ngc-standin: debootstrap $SUITE (minbase + python3, pip) from $mirror"
debootstrap --variant=minbase --include=python3,python3-pip,python-is-python3,ca-certificates \
  "$SUITE" "$root" "$mirror" > "$work/debootstrap.log" 2>&1 || {
  tail -n 20 "$work/debootstrap.log"
  exit 1
}

# torch and its dependencies as wheels for the image's Python, resolved by the host's pip
# (its index, find-links and certificates), so the chroot needs no pip configuration of its own.
echo "ngc-standin: ${SECONDS}s: fetching $TORCH_SPEC wheels"
cp=cp${SUITE_PYTHON/./}
python3 -m pip download -q -d "$wheels" --only-binary=:all: --python-version "$SUITE_PYTHON" --implementation cp \
  --abi "$cp" --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform linux_x86_64 \
  "$TORCH_SPEC" > "$work/pip-download.log" 2>&1 || {
  tail -n 20 "$work/pip-download.log"
  exit 1
}
mkdir -p "$root/tmp/wheels"
cp "$wheels"/*.whl "$root/tmp/wheels/"

# Extra CA certificates of this machine (the Debian ones come with ca-certificates).
if compgen -G "/usr/local/share/ca-certificates/*.crt" > /dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
fi

# env -i: the host's PIP_* settings (find-links, index) mean nothing inside the chroot.
env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 chroot "$root" /bin/bash -euo pipefail -c "
  update-ca-certificates > /dev/null 2>&1
  rm -f /usr/lib/python3*/EXTERNALLY-MANAGED          # NGC's system Python takes pip installs
  python -m pip install -q --no-warn-script-location --no-index --find-links /tmp/wheels '$TORCH_SPEC'
  mkdir -p /etc/pip
  python -m pip freeze > /etc/pip/constraint.txt
  useradd --uid 1000 --create-home --shell /bin/bash ubuntu
  rm -rf /tmp/wheels /var/cache/apt/archives/*.deb /var/lib/apt/lists/* /root/.cache
"

echo "ngc-standin: ${SECONDS}s: importing as $tag"
tar -C "$root" -c . | $DOCKER import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV PIP_CONSTRAINT=/etc/pip/constraint.txt' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  - "$tag" > /dev/null
rm -rf "$root"
echo "ngc-standin: ${SECONDS}s: $tag ready"
