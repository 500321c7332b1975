#!/usr/bin/env bash
# Build (once) the real-fast-plaid environment and run tests/hosts/fast_plaid/test_real_fast_plaid.py
# there (the folder's other tests need colpali-engine: the main .venv runs them).
#
#   ci/fastplaid_env.sh                 # build if needed, then run the fast-plaid tests
#   ci/fastplaid_env.sh --build-only    # only build the environment
#
# fast-plaid pins one exact torch per wheel (x.y.z.2110 -> torch==2.11.0), so it gets its own
# venv: torch 2.11.0 from PyPI (a CUDA build, about 5 GB with its CUDA libraries; it runs on the
# CPU), fast-plaid 1.7.0.2110 installed, fast-plaid 1.4.6.2110 unpacked into its own folder
# (the tests load each release in turn: FAST_PLAID_RELEASES), lik_plugins editable (--no-deps).
# Rebuilt only when the requirement files, pyproject.toml or setup.py change (stamp file).
# FASTPLAID_ENV overrides the location (default build/fastplaid-env, ignored by git).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ENV_DIR="${FASTPLAID_ENV:-$ROOT/build/fastplaid-env}"
VENV="$ENV_DIR/venv"
OLD_RELEASE="$ENV_DIR/fast-plaid-1.4.6"
PY="$VENV/bin/python"
STAMP="$ENV_DIR/.stamp"
want="$(cat ci/fastplaid-requirements.txt ci/fastplaid-146.txt pyproject.toml setup.py | sha1sum | cut -d' ' -f1)"

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
    echo "fastplaid_env: building $ENV_DIR" >&2
    mkdir -p "$ENV_DIR"
    test -x "$PY" || "${PYTHON:-python3}" -m venv "$VENV"
    # the machine-wide pip constraints may cap torch elsewhere; fast-plaid's own pin decides here
    PIP_CONSTRAINT= "$PY" -m pip install -q -r ci/fastplaid-requirements.txt
    rm -rf "$OLD_RELEASE"
    PIP_CONSTRAINT= "$PY" -m pip install -q --no-deps --target "$OLD_RELEASE" -r ci/fastplaid-146.txt
    "$PY" -m pip install -q --no-deps -e .
    echo "$want" > "$STAMP"
fi

[ "${1:-}" = "--build-only" ] && exit 0

export HF_HUB_OFFLINE=1 TRITON_INTERPRET=1 FAST_PLAID_RELEASES="installed:$OLD_RELEASE"
set +e
# the interpreter of triton 3.6 (torch 2.11's) warns on every indexed load under numpy 1.25+
"$PY" -m pytest -q -rs -p no:cacheprovider -W "ignore:Conversion of an array with ndim:DeprecationWarning" \
    tests/hosts/fast_plaid/test_real_fast_plaid.py
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "fastplaid_env: ERROR: pytest collected no tests (exit code 5)" >&2; exit 1; fi
exit $rc
