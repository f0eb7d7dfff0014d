"""Fixtures of the vLLM engine's test modules (they run in .vllm-venv; nothing here imports vLLM)."""

from __future__ import annotations

import os

import pytest
import torch

from workers.cpu_engine import SpecDecoder
from workers.models.tiny import save_tiny_pair, tiny_random_pair
from workers.vllm.faults import FAULTS_ENV
from workers.vllm.rules import TRACE_DIR_ENV


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """The tiny random pair on disk, head_dim 64 (vLLM's CPU attention rejects 16): "<draft>+<target>"."""
    root = tmp_path_factory.mktemp("tiny-h64")
    draft, target = save_tiny_pair(root, head_dim=64)
    return f"{draft}+{target}"


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    """The plugin traces every rule call here; fault injection reads ``faults.json`` here (off until a test
    writes it). Both reach vLLM's processes through the environment they inherit."""
    path = tmp_path_factory.mktemp("vllm-trace")
    os.environ[TRACE_DIR_ENV] = str(path)
    os.environ[FAULTS_ENV] = str(path / "faults.json")
    yield path
    os.environ.pop(TRACE_DIR_ENV, None)
    os.environ.pop(FAULTS_ENV, None)


@pytest.fixture(scope="module")
def cpu_engine():
    return SpecDecoder(tiny_random_pair(torch.float32, head_dim=64))
