#!/usr/bin/env bash
# Build llama-cpp-python for this machine so that it never crashes on it, and install it into the active Python.
#
# AMX: llama-cpp-python builds llama.cpp with GGML_NATIVE, which compiles llama.cpp's AMX kernels in on Intel CPUs
# that have AMX (Sapphire Rapids and later). Built by GCC < 13 (Debian 12's 12.2, Ubuntu 22.04's 11) those kernels
# segfault on the first decode (llama.cpp issue 20824): GCC drops the stores that fill the tile configuration before
# `_tile_loadconfig` reads it. On a CPU with AMX this script builds the pinned sdist with
# patches/llama-cpp-python-amx-tileconfig.patch (a compiler barrier before the load), which makes the kernels run:
# prefill ~1.6x faster on a 2-core Xeon. SPECDEC_AMX=off compiles AMX out instead (the build of earlier releases);
# on a CPU without AMX, and on other architectures, nothing changes.
#
# Flash attention by phase: every build also gets patches/llama-cpp-python-flash-attn-switch.patch, which adds
# `llama_set_flash_attn(ctx, on)`: flash attention on or off for the graphs built from then on. On the CPU specdec
# runs prefill chunks with it on (cheaper at long contexts) and, past 2,048 tokens of context, verify passes with it
# off (the CPU's flash-attention kernel walks the KV cache once per query row, so a pass over b tokens pays b times
# one token's attention). Without the patch (a llama-cpp-python installed some other way) specdec keeps one setting.
#
# The wheel is cached under a key made of the version, the CMake arguments, the patches, the Python tag and the CPU:
# pip's own wheel cache is keyed by version only, so a wheel built with other flags (or for another CPU, since the
# build uses -march=native) is never reused by mistake.
#
# This file and patches/ ship inside the specdec-cli package (specdec_cli/llama_build/): `specdec install-llama-cpp`
# runs it for the Python specdec runs on; in a checkout, scripts/install-llama-cpp.sh (what `make` runs) calls it.
#
#   specdec install-llama-cpp                                     # CPU (x86 with AMX: the patched AMX kernels)
#   specdec install-llama-cpp --amx off                           # x86: AMX compiled out (SPECDEC_AMX=off here)
#   CMAKE_ARGS="-DGGML_METAL=on" specdec install-llama-cpp        # Apple silicon (Metal is on by default there)
#   CMAKE_ARGS="-DGGML_CUDA=on" specdec install-llama-cpp         # NVIDIA GPU
#   PYTHON=.venv/bin/python bash install-llama-cpp.sh [--dry-run] # the script itself
#
# --dry-run prints what it would do, one name=value line each (version, python, prefix, patches, cmake_args, wheel_dir,
# state: installed | cached | build) and changes nothing.
#
# Environment: PYTHON (default: python), LLAMA_CPP_PYTHON_VERSION (default 0.3.36), SPECDEC_AMX (auto, off: at build
# time only; at run time specdec reads it as auto, keep or off), SPECDEC_WHEELS (default: ~/.cache/specdec/wheels),
# CMAKE_ARGS (appended to ours).
set -euo pipefail

dry_run=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    *) echo "install-llama-cpp.sh: unknown argument $arg (the only one is --dry-run)" >&2; exit 2 ;;
  esac
done

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
py="${PYTHON:-python}"
user_args="${CMAKE_ARGS:-}"

here="$(cd "$(dirname "$0")" && pwd)"
amx_patch="$here/patches/llama-cpp-python-amx-tileconfig.patch"
fa_patch="$here/patches/llama-cpp-python-flash-attn-switch.patch"

if [ -r /proc/cpuinfo ]; then
  cpu="$(grep -m1 -E '^(model name|Hardware)' /proc/cpuinfo || true) $(grep -m1 -E '^(flags|Features)' /proc/cpuinfo || true)"
else
  cpu="$(sysctl -n machdep.cpu.brand_string 2>/dev/null || uname -m)"
fi

args="$user_args"
patches=("$fa_patch")
case "$(uname -m)" in
  x86_64 | amd64 | i686 | i386)
    if [ "${SPECDEC_AMX:-auto}" != off ] && grep -qw amx_tile <<<"$cpu" && grep -qw amx_int8 <<<"$cpu"; then
      patches+=("$amx_patch")  # the AMX kernels, with the barrier that makes them run
    else
      amx_off="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
      args="-DCMAKE_C_FLAGS='$amx_off' -DCMAKE_CXX_FLAGS='$amx_off'${user_args:+ $user_args}"
    fi
    ;;
esac
patch_sum="$(cat "${patches[@]}" | sha256sum | cut -c1-64)"

tag="$("$py" -c 'import sys, sysconfig; print(sys.implementation.cache_tag, sysconfig.get_platform())')"
key="$(printf '%s\n%s\n%s\n%s\n%s\n' "$version" "$args" "$tag" "$cpu" "$patch_sum" | sha256sum | cut -c1-16)"
root="${SPECDEC_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/specdec/wheels}"
dir="$root/llama-cpp-python-$version-$key"

# Already installed into this Python from this very wheel: nothing to do (a second `make` costs a second, not a
# reinstall). The marker sits in the environment's prefix, so a new virtual environment installs afresh; and the
# installed llama_cpp must still be a patched build (it has llama_set_flash_attn), since a reinstall in place
# (`uv tool install --reinstall`, `pip install --force-reinstall`) brings back PyPI's stock build but keeps the marker.
prefix="$("$py" -c 'import sys; print(sys.prefix)')"
marker="$prefix/.llama-cpp-python-wheel"
patched_check='import sys, llama_cpp; sys.exit(0 if hasattr(llama_cpp.llama_cpp._lib, "llama_set_flash_attn") else 1)'
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$dir" ] && "$py" -c "$patched_check" 2>/dev/null; then
  state=installed
elif ls "$dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  state=cached
else
  state=build
fi
if [ "$dry_run" = 1 ]; then
  printf 'version=%s\npython=%s\nprefix=%s\npatches=%s\ncmake_args=%s\nwheel_dir=%s\nstate=%s\n' "$version" "$py" \
    "$prefix" "$(for p in "${patches[@]}"; do basename "$p"; done | paste -sd' ')" "$args" "$dir" "$state"
  exit 0
fi
if [ "$state" = installed ]; then
  echo "llama-cpp-python $version is installed from the wheel built for this machine: $dir" >&2
  exit 0
fi

# An environment made by `uv tool install` (or `uv venv`) has no pip: Python's own ensurepip adds it (offline).
if ! "$py" -m pip --version >/dev/null 2>&1; then
  echo "This Python has no pip; adding it with ensurepip" >&2
  "$py" -m ensurepip --upgrade --default-pip >/dev/null
fi

if ! ls "$dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  mkdir -p "$root"
  tmp="$(mktemp -d "$root/.building.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  echo "Building llama-cpp-python $version from its sdist with $(for p in "${patches[@]}"; do basename "$p"; done | paste -sd' ')" >&2
  "$py" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$tmp/src"
  tar -xzf "$tmp"/src/llama_cpp_python-*.tar.gz -C "$tmp/src"
  source="$(echo "$tmp"/src/llama_cpp_python-*/)"
  for p in "${patches[@]}"; do
    patch -p1 --forward --fuzz=0 -d "$source" <"$p"  # a changed source fails here, not at run time
  done
  echo "Building llama-cpp-python $version (~10 min on 2 cores; CMake's steps follow); CMAKE_ARGS=$args" >&2
  # --verbose: CMake's configuration and every compile step ([n/N] ...) are printed, so a long build shows progress
  CMAKE_ARGS="$args" "$py" -m pip wheel --verbose --no-cache-dir --no-deps "$source" -w "$tmp/wheel"
  rm -rf "$tmp/src"
  mv "$tmp"/wheel/*.whl "$tmp"/ && rmdir "$tmp/wheel"
  rm -rf "$dir"
  mv "$tmp" "$dir"  # atomic: a half-built wheel never has the final name
  trap - EXIT
else
  echo "Using the llama-cpp-python wheel built earlier with the same flags: $dir" >&2
fi
# --force-reinstall: a llama-cpp-python already installed with other flags is replaced.
"$py" -m pip install --force-reinstall --no-deps "$dir"/llama_cpp_python-*.whl
"$py" -m pip install "$dir"/llama_cpp_python-*.whl  # its dependencies (numpy, jinja2, diskcache, typing-extensions)
printf '%s\n' "$dir" >"$marker"
