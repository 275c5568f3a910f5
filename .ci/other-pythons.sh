#!/usr/bin/env bash
# CI step (.ci/run): the tests that need no torch, under every Python that setup.cfg's
# python_requires claims besides the one .ci/run tests with torch, each from pyenv.
#
# torch is a CPU wheel only for that one Python, and a CUDA torch is a download of
# several GB, so these environments install mplaunch without its dependencies (then the
# ones the tests need, not torch) and run the tests marked no_torch; the others skip
# where torch is missing (tests/conftest.py).
#
# A missing interpreter fails CI (CI=true): there it means python_requires claims what
# is not tested. On a developer's machine it is a loud warning, so that .ci/run still
# runs what it can there.
set -euo pipefail
cd "$(dirname "$0")/.."

pyenv_root=$( (command -v pyenv >/dev/null && pyenv root) || echo "${PYENV_ROOT:-$HOME/.pyenv}")
missing=()
failed=()
for minor in 3.9 3.10 3.12 3.13; do
    # the newest patch release of that minor version
    prefix=$( (ls -d "$pyenv_root/versions/$minor".[0-9]* 2>/dev/null || true) | sort -V | tail -n 1)
    if [ -z "$prefix" ] || [ ! -x "$prefix/bin/python" ]; then
        missing+=("$minor")
        continue
    fi
    echo "== Python $minor ($prefix): tests marked no_torch"
    venv=$(mktemp -d)
    if ! ( "$prefix/bin/python" -m venv "$venv" \
           && "$venv/bin/python" -m pip install -q cloudpickle tblib pytest pytest-timeout psutil \
           && "$venv/bin/python" -m pip install -q --no-deps -e . \
           && timeout 170 "$venv/bin/python" -m pytest -m no_torch -p no:cacheprovider -q ); then
        failed+=("$minor")
    fi
    rm -rf "$venv"
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!" >&2
    echo "!!! WARNING: no Python ${missing[*]} in $pyenv_root/versions." >&2
    echo "!!! setup.cfg claims it (python_requires), but it was NOT tested." >&2
    echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!" >&2
    if [ "${CI:-}" = true ]; then failed+=("${missing[@]}"); fi
fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: the no-torch tests under Python ${failed[*]}" >&2
    exit 1
fi
