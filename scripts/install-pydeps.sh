#!/usr/bin/env bash
# Install the Python packages that the tests use as oracles (scripts/requirements-test.txt) into a
# virtual environment, .pyenv/ at the repository root (ignored by git), from the package index.
# The library and the driver never need Python; tests that need a package skip themselves with a
# message when it is missing, unless TM_REQUIRE_PYDEPS=1 (CI) makes that a failure. They look for
# $TM_PYTHON, then .pyenv/bin/python, then python3.
#   scripts/install-pydeps.sh            (needs python3 with venv: Debian's python3-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
env_dir=${TM_PYENV:-.pyenv}
if [ ! -x "$env_dir/bin/python" ]; then
    python3 -m venv "$env_dir" || {
        echo "scripts/install-pydeps.sh: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2
        exit 1
    }
fi
"$env_dir/bin/python" -m pip install --quiet --disable-pip-version-check -r scripts/requirements-test.txt
"$env_dir/bin/python" -c 'import tensorboard, tokenizers, tiktoken, transformers; print("scripts/install-pydeps.sh: tensorboard", tensorboard.__version__, "tokenizers", tokenizers.__version__, "tiktoken", tiktoken.__version__, "transformers", transformers.__version__)'
