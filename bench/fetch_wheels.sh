#!/usr/bin/env bash
# The wheels bench/gpu_check.sh installs on a GPU machine without network, downloaded beforehand into wheels/
# (ignored by git), each with `pip download --no-deps`, at the versions this repository's environment has.
#
#   bash bench/fetch_wheels.sh [PYTHON_VERSION] [WHEEL_DIR]      # default 3.11 (the GPU image's), wheels/
#
# Assumed on the GPU image (not fetched): torch, accelerate, transformers and what they require (numpy, packaging,
# psutil, pyyaml, safetensors, tqdm, regex, tokenizers, filelock, requests, Pillow). Fetched: what a run imports
# beyond those, and the pure-Python requirements of diffusers, deepspeed, peft and webdataset the image may lack:
#   diffusers webdataset braceexpand peft deepspeed            the project's imports the image lacks
#   hjson py-cpuinfo einops msgpack ninja pydantic pydantic-core annotated-types typing-inspection   deepspeed's
#   importlib-metadata zipp lazy-importer                      diffusers'
#   xxhash                                                     data/remote.py's (shard checksums)
#   huggingface-hub typing-extensions pillow                   newer than an older image may have (diffusers needs
#   click fsspec hf-xet httpx2 httpcore2 anyio h11 idna truststore     huggingface-hub >= 1.32, with these)
# Binary wheels (msgpack, ninja, pydantic-core, xxhash, pillow, hf-xet) are fetched for CPython PYTHON_VERSION on
# manylinux x86_64. deepspeed is published as a source archive only: it is built here into a wheel (`pip wheel
# --no-deps --no-build-isolation`: its setup imports torch), with no compiled ops, as it installs from PyPI too.
# A package pip cannot find for that Python is reported and the others are still fetched.
set -u
cd "$(dirname "$0")/.."
PYV=${1:-3.11}
DEST=${2:-wheels}
PY=${PYTHON:-.venv/bin/python}
ABI=cp${PYV/./}
PACKAGES="diffusers webdataset braceexpand peft hjson py-cpuinfo einops msgpack ninja pydantic pydantic-core
annotated-types typing-inspection importlib-metadata zipp lazy-importer xxhash huggingface-hub typing-extensions pillow
click fsspec hf-xet httpx2 httpcore2 anyio h11 idna truststore"
mkdir -p "$DEST"

pinned() {  # the version this environment has, as pip's requirement (the bare name where it has none)
    local version
    version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null) \
        && echo "$1==$version" || echo "$1"
}

failed=()
for package in $PACKAGES; do
    requirement=$(pinned "$package")
    if ! "$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$DEST" --python-version "$PYV" \
            --implementation cp --abi "$ABI" --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any "$requirement"; then
        failed+=("$requirement")
    fi
done

deepspeed=$(pinned deepspeed)
sources=$(mktemp -d)
if "$PY" -m pip download --quiet --no-deps --no-binary=:all: --dest "$sources" "$deepspeed" \
        && "$PY" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$DEST" "$sources"/deepspeed-*; then
    :
else
    failed+=("$deepspeed")
fi
rm -rf "$sources"

ls -1 "$DEST"
du -sh "$DEST"
if [ ${#failed[@]} -gt 0 ]; then
    echo "not fetched for Python $PYV: ${failed[*]}" >&2
    exit 1
fi
