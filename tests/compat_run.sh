#!/usr/bin/env bash
# The compatibility part of `make test`: the tests marked `compat` (pytest -m compat) on one
# torch release, in a venv of its own under $COMPAT_VENVS (kept between runs: a CUDA build of
# torch is ~5 GB; the project is installed into it editable, from this checkout).
#   tests/compat_run.sh TORCH_VERSION REPORT_JSON [PYTEST_ARGS...]
# Exit: pytest's (5, no test selected, counts as success).
set -uo pipefail
version=$1; report=$2; shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
venvs=${COMPAT_VENVS:-$HOME/.cache/ckptrun/compat}
venv=$venvs/torch-$version
# pip here may be capped below the newest torch (a site config); this part asks for exact
# releases, so it reads no pip configuration file
export PIP_CONFIG_FILE=/dev/null
stamp="$(sha256sum "$root/pyproject.toml" | cut -c1-16) $root"
if [ "$(cat "$venv/.ckptrun-installed" 2>/dev/null)" != "$stamp" ]; then
  echo "compat: preparing $venv (torch==$version)"
  mkdir -p "$venvs"
  { [ -x "$venv/bin/python" ] || python3 -m venv "$venv"; } \
    && "$venv/bin/python" -m pip install -q "torch==$version" \
    && "$venv/bin/python" -m pip install -q -e "$root" pytest pytest-xdist \
    && "$venv/bin/python" -m compileall -q "$root/ckptrun" "$root/adapters" >/dev/null \
    && echo "$stamp" > "$venv/.ckptrun-installed" \
    || { echo "compat: could not prepare a venv with torch==$version"; exit 1; }
fi
shared=$(mktemp -d)
cd "$root"
CKPTRUN_TEST_SHARED_DIR=$shared CKPTRUN_COMPAT_REPORT=$report \
  "$venv/bin/python" -m pytest -n 2 --dist loadgroup -m compat -p no:cacheprovider \
  --durations=10 "$@"
rc=$?
rm -rf "$shared"
[ $rc = 5 ] && rc=0
exit $rc
