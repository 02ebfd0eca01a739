#!/usr/bin/env bash
# Make sure the Debian programs the tests start are installed: headless Chromium (the UI
# check of tests/test_e2e_dagster_dev.py) and the PostgreSQL server (the Postgres instance of
# tests/test_postgres_instance.py and `bench scale`). Installs the missing packages quietly
# (needs root or passwordless sudo); exits non-zero with a clear message if it cannot.
set -euo pipefail
CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
missing=()
[ -x "$CHROMIUM" ] || missing+=(chromium)
if ! command -v initdb >/dev/null && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    missing+=(postgresql)
fi
if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    echo "ensure_programs: ${missing[*]} missing and this user cannot install packages" \
        "(not root, no passwordless sudo); install the Debian packages: ${missing[*]}" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null; then
    echo "ensure_programs: ${missing[*]} missing and apt-get is not available;" \
        "install them (Chromium at $CHROMIUM, or set CHROMIUM=path)" >&2
    exit 1
fi
LOG="$(mktemp -t ensure_programs.XXXXXX.log)"
echo "ensure_programs: installing ${missing[*]} (log: $LOG)" >&2
export DEBIAN_FRONTEND=noninteractive
if ! { "${SUDO[@]}" apt-get update -qq && \
       "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$LOG" 2>&1; then
    echo "ensure_programs: apt-get failed to install ${missing[*]}; end of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
fi
if [ ! -x "$CHROMIUM" ]; then
    echo "ensure_programs: chromium was installed but $CHROMIUM does not exist" >&2
    exit 1
fi
rm -f "$LOG"
