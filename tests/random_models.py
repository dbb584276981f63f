"""The suite's random-weight models: benchmarks/random_gguf.py as a module, and its tiny GGUFs written into a tmp dir
(the session fixtures in conftest.py: lfm2_tiny, qwen35_tiny, mamba2_tiny)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def random_gguf():
    """benchmarks/random_gguf.py as a module: the generator of random-weight GGUFs (it needs the `gguf` package)."""
    if "random_gguf" not in sys.modules:
        path = Path(__file__).parents[1] / "benchmarks" / "random_gguf.py"
        spec = importlib.util.spec_from_file_location("random_gguf", path)
        module = sys.modules["random_gguf"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["random_gguf"]


def tiny_gguf(tmp_path_factory, arch: str) -> Path:
    """The tiny random-weight GGUF of `arch` (random_gguf.ARCH_SHAPES[arch]["tiny"], f16, seed 0) in a new tmp dir;
    skips the test where the `gguf` package is missing."""
    pytest.importorskip("gguf")
    rg = random_gguf()
    return rg.write(tmp_path_factory.mktemp(f"{arch}-tiny") / f"{arch}-tiny.gguf", rg.ARCH_SHAPES[arch]["tiny"])
