"""specdec: lossless speculative decoding for local GGUF models, shown token by token.

References:
    Leviathan, Kalman, Matias. "Fast Inference from Transformers via Speculative Decoding", ICML 2023.
    Chen et al. "Accelerating Large Language Model Decoding with Speculative Sampling", 2023.
    Saxena. "Prompt Lookup Decoding", 2023.
    Oliaro et al. "SuffixDecoding", arXiv 2411.04975, 2024.
"""

__version__ = "0.1.0"
