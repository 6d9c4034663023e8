#!/usr/bin/env bash
# .venv-cuda from wheelhouse/ without an index (docs/install.md), the wheelhouse first joined
# from the parts a node that shares no disk was given (/tmp/parts/part-*); nothing to do where
# .venv-cuda exists. The install's output goes to LOG (its tail is printed if it fails).
#
#   bash bench/gpu/install_offline.sh LOG
set -uo pipefail
[ -x .venv-cuda/bin/python ] && exit 0
[ -d wheelhouse ] || cat /tmp/parts/part-* | tar x || exit 1
make install DEVICE=cuda WHEELHOUSE=wheelhouse PYTHON=python3 >"$1" 2>&1 || {
    tail -30 "$1"
    exit 1
}
