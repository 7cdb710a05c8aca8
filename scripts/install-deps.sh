#!/usr/bin/env bash
# Install what tinymoe needs to build and test on Debian / Ubuntu (apt-get).
#   build-essential   C compiler, make
#   pkg-config        finds OpenBLAS and Criterion; tinymoe installs a tinymoe.pc
#   libcriterion-dev  the test framework (make test)
#   libopenblas-openmp-dev  CBLAS GEMM on the CPU, OpenMP build so BLAS and tinymoe's kernels
#                     share one thread pool (optional: without it a built-in kernel is used)
#   libopenmpi-dev, openmpi-bin   several ranks under mpirun (data, expert and ZeRO-1 parallelism)
#   zlib1g-dev        crc32 of checkpoints, deflate of integer tensors in them
#   libcjson-dev      cJSON, the JSON reader of the driver (Hugging Face config.json, safetensors headers)
#   libpcre2-dev      PCRE2, the regex engine of the driver's subword tokenizers: the Split patterns of a
#                     tokenizer.json (\p{L}, lookahead, ...) are run by it, not by code of our own
#   libutf8proc-dev   utf8proc, the Unicode NFC normalization that Qwen2's tokenizer.json asks for
#                     ("normalizer": {"type": "NFC"}): Unicode's own tables, kept up to date by others
#   cmake             only for the test that find_package(tinymoe) works on an install (make examples)
#   python3-venv      the virtual environment of the tests' Python oracles (scripts/install-pydeps.sh)
# The CUDA toolkit is not installed here; the Makefile uses it when nvcc is found.
set -euo pipefail

packages=(build-essential pkg-config libcriterion-dev libopenblas-openmp-dev libopenmpi-dev openmpi-bin zlib1g-dev
          libcjson-dev libpcre2-dev libutf8proc-dev cmake python3-venv)

if [ "$(id -u)" -eq 0 ]; then
    as_root=""
elif command -v sudo >/dev/null 2>&1; then
    as_root="sudo"
else
    echo "scripts/install-deps.sh: must run as root, or with sudo available" >&2
    exit 1
fi

# env: sudo drops the caller's environment by default.
$as_root env DEBIAN_FRONTEND=noninteractive apt-get update
$as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${packages[@]}"
