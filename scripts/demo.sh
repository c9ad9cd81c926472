#!/usr/bin/env bash
# The main job on embedded defaults: examples/banking.py over its JSONL sample, results in ./etl.db
# (SQLite), answers from the local SmolLM2 model. No services. Run it twice: the second run makes
# no LLM call and writes no row.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
etl run examples/banking.py "$@"
