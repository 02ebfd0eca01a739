#!/usr/bin/env bash
# Make sure headless Chromium is installed for the end-to-end `dagster dev` test.
# Installs the Debian `chromium` package quietly when /usr/bin/chromium is missing
# (needs root or passwordless sudo); exits non-zero with a clear message if it cannot.
set -euo pipefail
CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
if [ -x "$CHROMIUM" ]; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    echo "ensure_chromium: $CHROMIUM is missing and this user cannot install packages" \
        "(not root, no passwordless sudo); install the 'chromium' package" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null; then
    echo "ensure_chromium: $CHROMIUM is missing and apt-get is not available;" \
        "install Chromium so that $CHROMIUM exists (or set CHROMIUM=path)" >&2
    exit 1
fi
LOG="$(mktemp -t ensure_chromium.XXXXXX.log)"
echo "ensure_chromium: installing chromium (log: $LOG)" >&2
export DEBIAN_FRONTEND=noninteractive
if ! { "${SUDO[@]}" apt-get update -qq && \
       "${SUDO[@]}" apt-get install -y -qq --no-install-recommends chromium; } >"$LOG" 2>&1; then
    echo "ensure_chromium: apt-get failed to install chromium; end of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
fi
if [ ! -x "$CHROMIUM" ]; then
    echo "ensure_chromium: chromium was installed but $CHROMIUM does not exist" >&2
    exit 1
fi
rm -f "$LOG"
