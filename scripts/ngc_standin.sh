#!/usr/bin/env bash
# A registry-free stand-in for the NGC PyTorch base image, for `make image-smoke` on machines that
# cannot pull nvcr.io. It has what the Dockerfile relies on in the real image:
#   - a system Python with pip (not "externally managed") and `python` on PATH,
#   - torch installed into that Python (here the CPU wheel `pip install torch==2.13.0` resolves to),
#   - /etc/pip/constraint.txt pinning every installed package, with PIP_CONSTRAINT pointing at it
#     (NGC images have done this since 25.03),
#   - a uid-1000 user (`ubuntu` in the Ubuntu 24.04 based NGC images).
# Plus this machine's extra CA certificates, so that pip inside the build can reach PyPI through a
# TLS-inspecting egress. Debian bookworm (Python 3.11) where NGC 25.x has Ubuntu 24.04 (Python 3.12).
#
#   DOCKER="docker -H unix:///path/docker.sock" scripts/ngc_standin.sh TAG WORKDIR
#
# Needs root, debootstrap and network access to a Debian mirror and to the pip index.
set -euo pipefail

tag=${1:?usage: ngc_standin.sh TAG WORKDIR}
work=${2:?usage: ngc_standin.sh TAG WORKDIR}
DOCKER=${DOCKER:-docker}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

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

echo "ngc-standin: debootstrap bookworm (minbase + python3, pip) from $mirror"
debootstrap --variant=minbase --include=python3,python3-pip,python-is-python3,ca-certificates \
  bookworm "$root" "$mirror" > "$work/debootstrap.log" 2>&1 || {
  tail -n 20 "$work/debootstrap.log"
  exit 1
}

# torch and its dependencies as wheels for the image's Python (cp311), resolved by the host's pip
# (its index, find-links and certificates), so the chroot needs no pip configuration of its own.
echo "ngc-standin: ${SECONDS}s: fetching $TORCH_SPEC wheels"
python3 -m pip download -q -d "$wheels" --only-binary=:all: --python-version 3.11 --implementation cp \
  --abi cp311 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform linux_x86_64 \
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
