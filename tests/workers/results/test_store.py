"""Run and cache keys: readable, file-name safe, and never the same for two different texts."""

from __future__ import annotations

from pathlib import Path

from workers.evaluation import DecodeSpec
from workers.results.store import reference_dir, slug


def test_plain_names_stay_as_they_are():
    assert slug("gsm8k-qwen2.5-coder-0.5b+1.5b-fp32-n24-e3ccdec0") == "gsm8k-qwen2.5-coder-0.5b+1.5b-fp32-n24-e3ccdec0"


def test_long_or_rewritten_names_keep_a_readable_prefix_and_never_collide():
    base = "/models/" + "x" * 90
    a, b = slug(f"{base}/draft+{base}/target-bf16"), slug(f"{base}/draft+{base}/target-fp32")
    assert a != b, "cut at 80 characters, these two were one key"
    assert len(a) <= 80 and a.startswith("models_xxx")
    assert slug("org/name") != slug("org_name"), "a replaced character must not merge two names"
    assert slug("org/name") == slug("org/name"), "deterministic"


def test_reference_caches_of_long_local_pairs_in_two_dtypes_are_apart():
    spec = DecodeSpec.make("target-only", max_new_tokens=8)
    pair = "/data/checkpoints/" + "very-long-directory-name-" * 4 + "draft+/data/checkpoints/target"
    assert reference_dir(Path("r"), pair, "bf16", "gsm8k", spec) != reference_dir(Path("r"), pair, "fp32", "gsm8k", spec)


def test_the_fast_paths_references_are_kept_per_version_of_its_arithmetic():
    """A change to the fast path that moves outputs (FAST_NUMERICS) sends its references to a new cache: the old
    ones are not this code's target-only outputs. Other dtypes and other engines keep their place."""
    from workers.models.pair import FAST_NUMERICS
    from workers.results.store import reference_root

    root = Path("/runs")
    assert FAST_NUMERICS >= 2
    for tag in ("int8", "int4+int8"):
        assert reference_root(root, "p", tag).name == slug(f"p-{tag}-n{FAST_NUMERICS}")
    assert reference_root(root, "p", "bf16").name == slug("p-bf16")
    assert reference_root(root, "p", "int8", engine="vllm").name == slug("p@vllm-int8")
