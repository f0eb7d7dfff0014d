"""Everything that runs a draft/target pair on one machine, and judges what came out. No Ray.

The floor below ``cluster/`` (Ray actors, Serve) and ``jobs/`` (the commands; Optuna and MLflow):
nothing here imports ray, optuna, mlflow or anything from those two folders, and the acceptance
rules come from ``policies`` (pure tensor maths) unchanged. ``tests/test_layering.py`` checks it.

Where to look:

- ``models/``      the pair: the shipped Qwen2.5-Coder assets (fetch, verify, convert), loading a pair
                   (the shipped one, a tiny random one for tests, two local directories), its measured
                   draft/target cost ratio.
- ``cpu_engine``   the speculative-decoding engine on CPU (transformers, eager PyTorch): the reference
                   engine every test runs.
- ``vllm/``        everything that runs inside vLLM or drives it: the offline and async engines, the
                   ``vllm.general_plugins`` plugin that puts a spectune rule into vLLM's verification.
- ``engines``      an engine by name (``cpu`` | ``vllm``), the one door ``cluster/`` uses.
- ``stats``        per-generation counts (vLLM's names), modelled cost and speedup: both engines fill it.
- ``benchmarks/``  GSM8K, MMLU, HumanEval, IFEval, MT-bench: data from pinned wheels, prompts, scorers.
- ``evaluation``   one benchmark item through one rule -> one ``Record``.
- ``metrics``      records -> a trial's accuracy, drop, speedups and noise floor (descriptions).
- ``certify/``     the statistics of a certificate: bounds on a paired drop, early stopping, the
                   fixed-sequence confirmation, the sample-size planner. Pure Python and torch.
- ``cli``, ``prompts``  one-line errors for every command; chat messages -> prompt ids.
"""
