"""Measurement scripts: each prints the figures the docs quote (ratios side by side in one run, the
machine's load beside them). Run as ``python -m jobs.bench.<name> --help``.

- ``rules``: the cost of every acceptance rule next to the target's LM-head matmul.
- ``step``: one vLLM-shaped verify step through the plugin's ``decide_step`` vs vLLM's greedy argmax.
- ``cpu_engine``: the CPU engine on the real pair: target-only vs lossless vs lossy rules.
- ``quality``: accuracy and speed of the rules on the real pair, side by side.
- ``vllm_engine``: the vLLM engine: target-only, vLLM's lossless, spectune's lossless, lossy rules.
- ``batch``: throughput of one shard: CPU engine at batch 1, vLLM at batch 1, vLLM batched.
- ``sweep``: sweep throughput with 1 vs 2 pair actors.
- ``load_serve``: a bounded load test of the Serve endpoint.
- ``certify_level``: the certification decision's exact type-I error and the planner's exact power.
- ``frontier_lossless``: lossless at every L recomputed on an exported study's search items, and its frontier
  page's lossless table rebuilt from it.
"""
