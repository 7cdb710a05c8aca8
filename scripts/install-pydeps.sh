#!/usr/bin/env bash
# Install the Python packages that the tests use as oracles (scripts/requirements-test.txt) into a
# virtual environment, .pyenv/ at the repository root (ignored by git), from the package index.
# The library and the driver never need Python; tests that need a package skip themselves with a
# message when it is missing, unless TM_REQUIRE_PYDEPS=1 (CI) makes that a failure. They look for
# $TM_PYTHON, then .pyenv/bin/python, then python3.
#   scripts/install-pydeps.sh            (needs python3 with venv: Debian's python3-venv)
#   TM_TORCH=pypi scripts/install-pydeps.sh
#                                        also torch, for tests/test_hf_pipeline.c only: PyPI's
#                                        CUDA build, 7 GB (scripts/requirements-torch.txt says
#                                        why it is not the default; that test skips without
#                                        torch unless TM_REQUIRE_TORCH=1). TM_TORCH=cpu takes the
#                                        CPU build from PyTorch's index instead (not verified:
#                                        that index was out of reach where this was written).
set -euo pipefail
cd "$(dirname "$0")/.."
env_dir=${TM_PYENV:-.pyenv}
if [ ! -x "$env_dir/bin/python" ]; then
    python3 -m venv "$env_dir" || {
        echo "scripts/install-pydeps.sh: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2
        exit 1
    }
fi
pip=("$env_dir/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" -r scripts/requirements-test.txt
torch_version=$(sed -n 's/^torch==\([0-9.]*\).*/\1/p' scripts/requirements-torch.txt)
have_torch=$("$env_dir/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
case "${TM_TORCH:-none}" in
    none) ;;
    pypi | cpu)
        if [ "$have_torch" != "$torch_version" ]; then # either build of that version will do
            if [ "$TM_TORCH" = pypi ]; then
                "${pip[@]}" "torch==$torch_version"
            else
                "${pip[@]}" --extra-index-url https://download.pytorch.org/whl/cpu "torch==$torch_version+cpu" || {
                    echo "scripts/install-pydeps.sh: torch's CPU build could not be installed from" \
                         "https://download.pytorch.org/whl/cpu (everything else is): TM_TORCH=pypi takes PyPI's CUDA build" >&2
                    exit 1
                }
            fi
        fi ;;
    *) echo "scripts/install-pydeps.sh: TM_TORCH=$TM_TORCH: none (default), pypi or cpu" >&2; exit 2 ;;
esac
"$env_dir/bin/python" -c '
import importlib.util
import tensorboard, tokenizers, tiktoken, transformers
torch = importlib.import_module("torch").__version__ if importlib.util.find_spec("torch") else "none (TM_TORCH=pypi installs it)"
print("scripts/install-pydeps.sh: tensorboard", tensorboard.__version__, "tokenizers", tokenizers.__version__,
      "tiktoken", tiktoken.__version__, "transformers", transformers.__version__, "torch", torch)'
