#!/usr/bin/env bash
# Refresh requirements/lock.txt: install the project with every extra but `gpu` into a new virtualenv, letting pip
# take the newest versions that pyproject.toml allows, and write what it installed as exact pins.
#
#   bash requirements/refresh_lock.sh            # then run the suite (.ci/run) and fix what the new versions break
#
# The lock is for Linux x86_64, Python 3.11 and the CPU build of torch (its version is the one named in the
# README's commands). It is used as pip *constraints* (`pip install -c requirements/lock.txt ...`): each command
# installs only what its extras need, at the locked versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TORCH="$(grep -oE 'torch==[0-9][0-9.]*' .ci/run | head -1)"
[ -n "$TORCH" ] || { echo "refresh_lock: no torch==X pin found in .ci/run" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --upgrade pip
"$tmp/venv/bin/python" -m pip install -q "$TORCH" -e ".[demo,test,bench,openvino]"
{
  echo "# Exact versions for the README's commands and CI (pip constraints: pip install -c requirements/lock.txt ...)."
  echo "# Platform: Linux $(uname -m), Python $("$tmp/venv/bin/python" -c 'import platform; print(platform.python_version())'), the CPU build of torch; every extra but gpu."
  echo "# Written by requirements/refresh_lock.sh (the newest versions pyproject.toml allows); the suite passed with them."
  # the local version label (+cpu) is dropped: torch==X matches the CPU wheel wherever it is found
  "$tmp/venv/bin/python" -m pip freeze --exclude-editable | sed -E 's/^(torch==[^+]+)\+.*/\1/' | LC_ALL=C sort -f
} > requirements/lock.txt.tmp
mv requirements/lock.txt.tmp requirements/lock.txt
echo "refresh_lock: wrote requirements/lock.txt ($(grep -vc '^#' requirements/lock.txt) packages)"
