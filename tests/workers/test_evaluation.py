"""A record says how it was made: the torch threads of the process that decoded it and spectune's code version,
so an audit of a certificate's evidence can tell where replay was exact; records from before these fields load with
"unknown" (0, "")."""

from __future__ import annotations

import json

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
