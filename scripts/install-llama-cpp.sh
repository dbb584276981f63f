#!/usr/bin/env bash
# Build llama-cpp-python for this machine so that it never crashes on it, and install it into the active Python.
#
# Why: llama-cpp-python builds llama.cpp with GGML_NATIVE, which compiles llama.cpp's AMX kernels in on Intel
# CPUs that have AMX (Sapphire Rapids and later). Those kernels segfault on the first decode (llama.cpp issue
# 20824). Compiling AMX out keeps llama.cpp's other CPU kernels (AVX2/AVX-512 and the repacked Q4 layouts).
#
# The wheel is cached under a key made of the version, the CMake arguments, the Python tag and the CPU: pip's own
# wheel cache is keyed by version only, so a wheel built with other flags (or for another CPU, since the build uses
# -march=native) is never reused by mistake.
#
#   scripts/install-llama-cpp.sh                                  # CPU (x86: AMX compiled out)
#   CMAKE_ARGS="-DGGML_METAL=on" scripts/install-llama-cpp.sh     # Apple silicon (Metal is on by default there)
#   CMAKE_ARGS="-DGGML_CUDA=on" scripts/install-llama-cpp.sh      # NVIDIA GPU
#
# Environment: PYTHON (default: python), LLAMA_CPP_PYTHON_VERSION (default 0.3.36),
# SPECDEC_WHEELS (default: ~/.cache/specdec/wheels), CMAKE_ARGS (appended to ours).
set -euo pipefail

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
py="${PYTHON:-python}"
user_args="${CMAKE_ARGS:-}"

args="$user_args"
case "$(uname -m)" in
  x86_64 | amd64 | i686 | i386)
    amx_off="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    args="-DCMAKE_C_FLAGS='$amx_off' -DCMAKE_CXX_FLAGS='$amx_off'${user_args:+ $user_args}"
    ;;
esac

if [ -r /proc/cpuinfo ]; then
  cpu="$(grep -m1 -E '^(model name|Hardware)' /proc/cpuinfo || true) $(grep -m1 -E '^(flags|Features)' /proc/cpuinfo || true)"
else
  cpu="$(sysctl -n machdep.cpu.brand_string 2>/dev/null || uname -m)"
fi
tag="$("$py" -c 'import sys, sysconfig; print(sys.implementation.cache_tag, sysconfig.get_platform())')"
key="$(printf '%s\n%s\n%s\n%s\n' "$version" "$args" "$tag" "$cpu" | sha256sum | cut -c1-16)"
root="${SPECDEC_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/specdec/wheels}"
dir="$root/llama-cpp-python-$version-$key"

# Already installed into this Python from this very wheel: nothing to do (a second `make` costs a second, not a
# reinstall). The marker sits in the environment's prefix, so a new virtual environment installs afresh.
marker="$("$py" -c 'import sys; print(sys.prefix)')/.llama-cpp-python-wheel"
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$dir" ] && "$py" -c 'import llama_cpp' 2>/dev/null; then
  echo "llama-cpp-python $version is installed from the wheel built for this machine: $dir" >&2
  exit 0
fi

if ! ls "$dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "Building llama-cpp-python $version (~10 min on 2 cores; CMake's steps follow); CMAKE_ARGS=$args" >&2
  mkdir -p "$root"
  tmp="$(mktemp -d "$root/.building.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  # --verbose: CMake's configuration and every compile step ([n/N] ...) are printed, so a long build shows progress
  CMAKE_ARGS="$args" "$py" -m pip wheel --verbose --no-cache-dir --no-deps "llama-cpp-python==$version" -w "$tmp"
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
