#!/usr/bin/env bash
# CI step (.ci/run): DeepSpeed's init_distributed() in mplaunch ranks, in the README's
# environment. DeepSpeed ships only a source distribution whose build imports torch: an
# isolated build would download a CUDA torch of several GB, so it is built against the
# torch already installed (--no-build-isolation), without its C++ ops (it compiles the
# one it needs on CPU at first use). Not in the test extra for that reason.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
start=$SECONDS
pip install -q --no-build-isolation deepspeed
# -m "": the DeepSpeed test is marked slow, which pytest.ini leaves out of a plain run
python -m pytest -p no:cacheprovider -q -m "" tests/test_frameworks.py -k deepspeed
echo "== deepspeed: $((SECONDS - start)) s"
