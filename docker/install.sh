#!/bin/sh
# The image's install steps: the Dockerfile's build stage runs them, tests/test_image.py runs them too.
#   sh docker/install.sh VENV                          the pinned environment into a new virtual environment VENV,
#                                                      this project into it (not editable), both CPU kernel flavours
#                                                      compiled into $TORCH_EXTENSIONS_DIR
#   sh docker/install.sh VENV --dry-run --python PY    pip resolves every pin against the index and installs nothing;
#                                                      the kernels are compiled with the python PY (the test's)
set -eu
cd "$(dirname "$0")/.."
venv=${1:?usage: sh docker/install.sh VENV [--dry-run --python PY]}
dry="--quiet" py="$venv/bin/python"
if [ "${2:-}" = "--dry-run" ]; then dry="--dry-run" py=${4:?--dry-run needs --python PY}; fi
: "${TORCH_EXTENSIONS_DIR:?set TORCH_EXTENSIONS_DIR: where the kernels are compiled}"
python3 -m venv "$venv"
pip="$venv/bin/pip install --no-cache-dir --disable-pip-version-check $dry"
$pip -r requirements.txt
$pip --no-deps -r requirements-nodeps.txt
$pip --no-deps .
"$py" -m spork_trt.engines.cpu.kernels --prebuild
