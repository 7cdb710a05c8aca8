#!/usr/bin/env bash
# Install the Python packages that tinymoe's oracle tests compare against, from the package index
# (pip), into the python3 that the tests run (tests/test_bpe.c runs `python3 tests/bpe_oracle.py`):
#   tokenizers   Hugging Face's tokenizers: the byte-level BPE reference (train/bpe.c)
#   tiktoken     OpenAI's tokenizer: the cl100k-style split reference
# Without them those tests skip, saying why; under CI (CI set) they fail instead, so .ci/run
# calls this script. Versions are not pinned: the tests compare behaviour that these libraries
# keep stable (ids of a tokenizer.json), and a change there is worth hearing about.
set -euo pipefail

if ! command -v python3 >/dev/null 2>&1; then
    echo "scripts/install-test-deps.sh: python3 is not installed (Debian: apt-get install python3 python3-pip)" >&2
    exit 1
fi
if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "scripts/install-test-deps.sh: python3 has no pip (Debian: apt-get install python3-pip)" >&2
    exit 1
fi
packages=(tokenizers tiktoken)
# Debian's python3 marks itself externally managed (PEP 668); these two packages are
# self-contained wheels that touch nothing of the system's, so install them beside it.
extra=()
if python3 -m pip install --help 2>/dev/null | grep -q -- --break-system-packages; then
    if python3 -c 'import sys, sysconfig, os; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) else 1)'; then
        extra+=(--break-system-packages)
    fi
fi
python3 -m pip install --quiet --disable-pip-version-check "${extra[@]}" "${packages[@]}"
python3 -c 'import tokenizers, tiktoken; print("tokenizers", tokenizers.__version__, "tiktoken", tiktoken.__version__)'
