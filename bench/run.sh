#!/usr/bin/env bash
# All benchmarks against real Kafka and PostgreSQL (started natively on 127.0.0.1); writes
# bench/RESULTS.md. About 20 minutes on 2 cores. `bash bench/run.sh replay cold` runs a subset.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
python -c "import quixstreams" 2>/dev/null || python -m pip install -q -e ".[bench]" >&2  # the quix section's peer
eval "$(services/services.sh start)"
python -m bench.run "$@"
