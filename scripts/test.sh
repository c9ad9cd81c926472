#!/usr/bin/env bash
# The whole test suite against real services: installs the project, starts PostgreSQL and Apache
# Kafka natively on 127.0.0.1 (services/services.sh), runs pytest. Extra arguments go to pytest.
# Services are stopped at the end unless ETL_KEEP_SERVICES=1.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
eval "$(services/services.sh start)"
if [ "${ETL_KEEP_SERVICES:-0}" != "1" ]; then
    trap 'services/services.sh stop >/dev/null 2>&1 || true' EXIT
fi
python -m pytest -p no:cacheprovider "$@"
