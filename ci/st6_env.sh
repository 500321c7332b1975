#!/usr/bin/env bash
# Build (once) one environment per sentence-transformers 6.x release and run
# tests/hosts/sentence_transformers in each.
#
#   ci/st6_env.sh                      # every release of the matrix: build if needed, then test
#   ci/st6_env.sh 6.3                  # only the releases named
#   ci/st6_env.sh --build-only [REL..] # only build (ci/host_suites.py needs .venv-st6)
#
# The matrix: the oldest 6.x (6.0), the release ST's own suite runs against in ci/host_suites.py
# (6.2, kept at .venv-st6, the interpreter that script uses) and the newest (6.3, with `kernels`).
# Each environment is built from ci/st6-requirements-<release>.txt.  Two stamps decide what
# is redone: the requirements' stamp rebuilds the environment's packages; the package stamp
# (pyproject.toml, setup.py, the .pth file) only reinstalls lik_plugins, editable and --no-deps,
# so the start-up hook (LIK_PATCH=...) is active there too.  ST6_RELEASES overrides the matrix.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

build_only=0
if [ "${1:-}" = "--build-only" ]; then build_only=1; shift; fi
releases=("$@")
[ ${#releases[@]} -eq 0 ] && read -r -a releases <<< "${ST6_RELEASES:-6.0 6.2 6.3}"

venv_of() {  # 6.2 stays at the path ci/host_suites.py reads
    if [ "$1" = "6.2" ]; then echo "$ROOT/.venv-st6"; else echo "$ROOT/.venv-st$1"; fi
}

build() {
    local release="$1" venv py requirements want_deps want_pkg
    venv="$(venv_of "$release")"
    py="$venv/bin/python"
    requirements="ci/st6-requirements-$release.txt"
    [ -f "$requirements" ] || { echo "st6_env: no $requirements" >&2; return 1; }
    want_deps="$(cat ci/st6-requirements.txt "$requirements" | sha1sum | cut -d' ' -f1)"
    want_pkg="$(cat pyproject.toml setup.py lik_plugins_autoactivate.pth | sha1sum | cut -d' ' -f1)"
    if [ ! -f "$venv/.st6-deps-stamp" ] || [ "$(cat "$venv/.st6-deps-stamp")" != "$want_deps" ]; then
        echo "st6_env: building $venv (sentence-transformers $release)" >&2
        local start=$SECONDS
        test -x "$py" || "${PYTHON:-python3}" -m venv "$venv"
        echo '*' > "$venv/.gitignore"   # the folder stays out of git status, whatever its name
        "$py" -m pip install -q -r "$requirements" 2> >(grep -v "is ignored: it is neither" >&2)
        echo "$want_deps" > "$venv/.st6-deps-stamp"
        rm -f "$venv/.st6-pkg-stamp"
        echo "st6_env: built $venv in $((SECONDS - start)) s" >&2
    fi
    if [ ! -f "$venv/.st6-pkg-stamp" ] || [ "$(cat "$venv/.st6-pkg-stamp")" != "$want_pkg" ]; then
        "$py" -m pip install -q --no-deps -e . 2> >(grep -v "is ignored: it is neither" >&2)
        echo "$want_pkg" > "$venv/.st6-pkg-stamp"
    fi
}

for release in "${releases[@]}"; do build "$release"; done
[ $build_only -eq 1 ] && exit 0

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRITON_INTERPRET=1
TOTALS='^=*\s*([0-9]+ [a-z]+(, )?)+ in [0-9.]+s'   # pytest's closing line, as ci/make_test.py reads it
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
failed=()
all_start=$SECONDS
for release in "${releases[@]}"; do
    py="$(venv_of "$release")/bin/python"
    echo "st6_env: sentence-transformers $release ($py)" >&2
    start=$SECONDS
    set +e
    "$py" -m pytest -q -rs -p no:cacheprovider tests/hosts/sentence_transformers 2>&1 | tee "$logs/$release.log"
    rc=${PIPESTATUS[0]}
    set -e
    totals="$(grep -E "$TOTALS" "$logs/$release.log" | tail -1 | sed -E 's/^=+ *//; s/ in [0-9.]+s.*//')"
    echo "st6_env: sentence-transformers $release: ${totals:-no totals}, exit $rc, $((SECONDS - start)) s" >&2
    if [ $rc -eq 5 ]; then echo "st6_env: ERROR: pytest collected no tests on $release (exit code 5)" >&2; fi
    [ $rc -ne 0 ] && failed+=("$release")
done
# One closing line over the whole matrix, in pytest's format, so a reader of the last totals
# line (ci/make_test.py) counts every release, not only the last one.
combined="$(cat "$logs"/*.log | grep -E "$TOTALS" | grep -oE '[0-9]+ [a-z]+' | awk '
    { n[$2] += $1; if (!($2 in seen)) { seen[$2] = 1; order[++k] = $2 } }
    END { for (i = 1; i <= k; i++) printf "%s%d %s", (i > 1 ? ", " : ""), n[order[i]], order[i] }')"
echo "======== ${combined:-0 passed} in $((SECONDS - all_start)).0s (sentence-transformers ${releases[*]}) ========"
if [ ${#failed[@]} -gt 0 ]; then echo "st6_env: failed on: ${failed[*]}" >&2; exit 1; fi
exit 0
