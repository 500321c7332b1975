#!/usr/bin/env bash
# Build (once) the sentence-transformers 6.x environment and run tests/hosts/sentence_transformers there.
#
#   ci/st6_env.sh                 # build .venv-st6 if needed, then run the ST 6 tests
#   ci/st6_env.sh --build-only    # only build the environment (used by ci/host_suites.py)
#
# The environment is rebuilt only when ci/st6-requirements.txt, pyproject.toml, setup.py or the
# .pth file change (stamp file); lik_plugins is installed editable (--no-deps) so the start-up
# hook (LIK_PATCH=...) is active there too.  ST6_VENV overrides the location.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${ST6_VENV:-$ROOT/.venv-st6}"
PY="$VENV/bin/python"
STAMP="$VENV/.st6-stamp"
want="$(cat ci/st6-requirements.txt pyproject.toml setup.py lik_plugins_autoactivate.pth | sha1sum | cut -d' ' -f1)"

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
    echo "st6_env: building $VENV" >&2
    test -x "$PY" || "${PYTHON:-python3}" -m venv "$VENV"
    "$PY" -m pip install -q -r ci/st6-requirements.txt
    "$PY" -m pip install -q --no-deps -e .
    echo "$want" > "$STAMP"
fi

[ "${1:-}" = "--build-only" ] && exit 0

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRITON_INTERPRET=1
set +e
"$PY" -m pytest -q -rs -p no:cacheprovider tests/hosts/sentence_transformers
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "st6_env: ERROR: pytest collected no tests (exit code 5)" >&2; exit 1; fi
exit $rc
