# Sourced by the other scripts: a project virtualenv with idem-etl and its test extras installed.
# The first install compiles llama.cpp (llama-cpp-python; ~6 min on 2 cores); pip's cache makes
# later ones fast. Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if [ ! -f .venv/.installed ] || [ pyproject.toml -nt .venv/.installed ]; then
    echo "installing idem-etl into .venv (first time: compiles llama.cpp, several minutes)..." >&2
    .venv/bin/python -m pip install -q --upgrade pip >&2
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
        .venv/bin/python -m pip install -q -e ".[test]" >&2
    touch .venv/.installed
fi
export PATH="$PWD/.venv/bin:$PATH"
