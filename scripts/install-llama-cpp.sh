#!/usr/bin/env bash
# Build llama-cpp-python for this machine (patched: the flash-attention switch everywhere, the AMX tile fix on CPUs
# with AMX) and install it into $PYTHON. The script and its patches ship inside the package, so that an installed
# specdec has them too (`specdec install-llama-cpp` runs the same file for the Python specdec runs on); this wrapper
# keeps the checkout's path working for `make`. Its documentation, variables and --dry-run: the file it runs.
exec bash "$(cd "$(dirname "$0")" && pwd)/../specdec_cli/llama_build/install-llama-cpp.sh" "$@"
