#!/usr/bin/env bash
# The whole test suite against real services: installs the project, starts PostgreSQL and Apache
# Kafka natively on 127.0.0.1 (services/services.sh), installs Debian's chromium if missing (the
# review pages' browser tests), runs pytest. Extra arguments go to pytest.
# Services are stopped at the end unless ETL_KEEP_SERVICES=1.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
# The review pages are tested in a real browser: Debian's chromium, driven by Playwright.
if ! command -v "${ETL_CHROMIUM:-chromium}" >/dev/null 2>&1; then
    echo "installing chromium (Debian's package) for the review page tests..." >&2
    as_root=$( [ "$(id -u)" = 0 ] || echo sudo )
    $as_root apt-get install -y -q chromium >&2 || { $as_root apt-get update -q >&2 && $as_root apt-get install -y -q chromium >&2; }
fi
eval "$(services/services.sh start)"
if [ "${ETL_KEEP_SERVICES:-0}" != "1" ]; then
    trap 'services/services.sh stop >/dev/null 2>&1 || true' EXIT
fi
python -m pytest -p no:cacheprovider "$@"
