#!/usr/bin/env bash
# scripts/check-cmake.sh PREFIX WORKDIR — a CMake project that finds the tinymoe installed in
# PREFIX with find_package(tinymoe 0.1 REQUIRED), builds examples/hello.c against
# tinymoe::tinymoe (shared) and tinymoe::tinymoe_static, and runs both (make examples calls it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
prefix=$1 work=$2
rm -rf "$work" && mkdir -p "$work/src"
cp "$root/examples/hello.c" "$work/src/"
cat > "$work/src/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.13)
project(tinymoe_hello C)
find_package(tinymoe 0.1 REQUIRED)
add_executable(hello_shared hello.c)
target_link_libraries(hello_shared PRIVATE tinymoe::tinymoe)
set_target_properties(hello_shared PROPERTIES BUILD_RPATH "${tinymoe_INCLUDE_DIRS}/../lib")
add_executable(hello_static hello.c)
target_link_libraries(hello_static PRIVATE tinymoe::tinymoe_static)
CMAKE
cmake -S "$work/src" -B "$work/build" -DCMAKE_PREFIX_PATH="$prefix" > "$work/configure.log" 2>&1 ||
    { cat "$work/configure.log" >&2; exit 1; }
cmake --build "$work/build" > "$work/build.log" 2>&1 || { cat "$work/build.log" >&2; exit 1; }
for v in shared static; do
    (cd "$work" && "$work/build/hello_$v" > "$work/hello_$v.log" 2>&1) || { cat "$work/hello_$v.log" >&2; exit 1; }
done
echo "cmake: find_package(tinymoe) found $prefix; hello_shared and hello_static built and ran"
