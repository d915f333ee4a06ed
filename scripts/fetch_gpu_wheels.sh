#!/usr/bin/env bash
# Fetch, on a machine with internet, the wheels a GPU box without internet needs to run the notebooks under
# nbval (and, with PEERS=1, the optional FlashMLA peer): run it here, carry the folder to the GPU box, then
# `bash scripts/gpu-check.sh` installs them (it looks for .whl/*.whl) before its stages.
#
#   bash scripts/fetch_gpu_wheels.sh                 # cp312 manylinux x86-64 wheels into .whl/
#   PY=3.11 DEST=wheels bash scripts/fetch_gpu_wheels.sh
#   PEERS=1 bash scripts/fetch_gpu_wheels.sh         # also sgl-flash-mla (FlashMLA's SM90 kernels), --no-deps
#   LAB=1 bash scripts/fetch_gpu_wheels.sh           # also JupyterLab, for tests/test_lab.py on the GPU box
#
# The notebook stack is resolved with its dependencies for the target Python and platform; the wheels of
# packages a CUDA image normally has already (torch, numpy, pytest, ... : HAVE below) are dropped, and so are
# debugpy and jedi (a kernel runs without them: no debugger, no completion). What stays came to 31 wheels, about 6 MB,
# for Python 3.12 on 2026-12-04; the script refuses to leave more than 60 MB.
set -euo pipefail
PY=${PY:-3.12}
DEST=${DEST:-.whl}
STACK=${STACK:-"nbval jupytext ipykernel nbformat nbclient"}
[ "${LAB:-0}" = 1 ] && STACK="$STACK jupyterlab"
HAVE=${HAVE:-"torch triton numpy pytest pytest_xdist execnet hypothesis safetensors einops matplotlib contourpy cycler \
fonttools kiwisolver pillow pyparsing packaging psutil pygments pyyaml python_dateutil six attrs jinja2 markupsafe \
markdown_it_py mdurl typing_extensions pluggy iniconfig coverage sortedcontainers debugpy jedi parso"}
abi=cp${PY/./}
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
mkdir -p "$DEST"
python3 -m pip download -q --only-binary=:all: --python-version "$PY" --implementation cp --abi "$abi" --abi abi3 \
  --abi none "${plat[@]}" -d "$DEST" $STACK
if [ "${PEERS:-0}" = 1 ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp --abi "$abi" \
    --abi abi3 --abi none "${plat[@]}" -d "$DEST" sgl-flash-mla==1.0.0
fi
for name in $HAVE; do  # wheel file names spell a project with underscores, in lower case
  rm -f "$DEST/${name}"-[0-9]*.whl
done
# babel (a JupyterLab dependency) is 11 MB, nearly all of it the locale data of ~1,100 locales; the server only
# needs English to start, so keep root and en* and drop the rest (the wheel stays installable: pip does not
# check RECORD hashes of a local wheel).
for w in "$(cd "$DEST" && pwd)"/babel-*.whl; do
  [ -e "$w" ] || continue
  tmp=$(mktemp -d)
  (cd "$tmp" && python3 -m zipfile -e "$w" . && find babel/locale-data -name '*.dat' ! -name 'root.dat' ! -name 'en.dat' \
     ! -name 'en_*.dat' -delete && rm -f "$w" && python3 -m zipfile -c "$w" ./*)
  rm -rf "$tmp"
done
n=$(ls "$DEST"/*.whl | wc -l)
mb=$(du -sm "$DEST" | cut -f1)
echo "fetch_gpu_wheels: $n wheels, $mb MB in $DEST (Python $PY)"
[ "$n" -gt 0 ] || { echo "fetch_gpu_wheels: no wheels fetched" >&2; exit 1; }
[ "$mb" -le 60 ] || { echo "fetch_gpu_wheels: $mb MB is more than a carried folder may hold (64 MiB in all)" >&2; exit 1; }
