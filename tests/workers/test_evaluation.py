"""A record says how it was made: the torch threads of the process that decoded it and spectune's code version,
so an audit of a certificate's evidence can tell where replay was exact; records from before these fields load with
"unknown" (0, "")."""

from __future__ import annotations

import json

import pytest
import torch

from workers.benchmarks import get_benchmark
from workers.cpu_engine import SpecDecoder
from workers.evaluation import DecodeSpec, Record, code_version, evaluate_item
from workers.models.pair import load_pair


def test_a_record_names_its_threads_and_code_version():
    engine = SpecDecoder(load_pair("tiny-random", dtype=torch.float32))
    bench = get_benchmark("gsm8k")
    item = bench.items(limit=1)[0]
    record = evaluate_item(engine, bench, item, DecodeSpec.make("lossless", {}, 2, max_new_tokens=4))
    assert record.error is None and record.threads == torch.get_num_threads() >= 1
    assert record.code == code_version() and (record.code.startswith("git:") or record.code.startswith("spectune "))
    old = {k: v for k, v in json.loads(json.dumps(record.to_row())).items() if k not in ("threads", "code")}
    again = Record.from_row(old)
    assert (again.threads, again.code) == (0, "") and again.outputs == record.outputs


def test_truncation_keys_a_spec_only_where_it_truncates():
    """top-k / top-p off leave a spec's key and settings as they were before the fields existed (cached
    references and committed runs keep their names: 0b540b3ce21f is that key, computed by the code before them);
    set, they enter both, so a truncated run never shares a cache or a pairing with an untruncated one."""
    plain = DecodeSpec.make("kl_judge", {"threshold": 0.5}, 3, temperature=0.7)
    assert plain.key() == "0b540b3ce21f"
    assert plain.settings_key() == {"temperature": 0.7, "seed": 0, "max_new_tokens": 256, "shots": 0}
    assert plain.truncation() == {}
    nucleus = DecodeSpec.make("kl_judge", {"threshold": 0.5}, 3, temperature=0.7, top_p=0.9)
    both = DecodeSpec.make("kl_judge", {"threshold": 0.5}, 3, temperature=0.7, top_p=0.9, top_k=20)
    assert nucleus.truncation() == {"top_p": 0.9} and both.truncation() == {"top_k": 20, "top_p": 0.9}
    assert len({plain.key(), nucleus.key(), both.key()}) == 3
    assert nucleus.settings_key()["top_p"] == 0.9 and "top_k" not in nucleus.settings_key()
    for bad in ({"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 2.5}, {"top_p": float("nan")}):
        with pytest.raises(ValueError, match="top_k|top_p"):
            DecodeSpec.make("kl_judge", {"threshold": 0.5}, 3, temperature=0.7, **bad)
