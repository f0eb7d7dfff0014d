"""Everything that runs inside vLLM or drives it.

Driving vLLM (front-end process):

- ``engine``: ``VLLMDecoder``, the offline engine (sweeps, evaluation; batches of items in one
  ``generate``), the same interface and statistics as ``workers.cpu_engine.SpecDecoder``.
- ``async_engine``: ``AsyncVLLMDecoder`` on vLLM's ``AsyncLLM`` for serving (continuous batching,
  a rule per request, streaming, aborts).
- ``common``: what both engines share (engine arguments, the plugin check, a request's rule in
  ``SamplingParams.extra_args``, a ``RequestOutput`` as a ``Generation``).
- ``batch_eval``: benchmark items through the offline engine, each turn of every item in one ``generate``.
- ``settings``: ``VLLMSettings`` and the parts that need no running vLLM (CPU thread binding, metric
  mapping, declared EOS ids).

Inside vLLM's processes (loaded by vLLM itself through the ``vllm.general_plugins`` entry point
``spectune_rules = workers.vllm.plugin:register``, so ``vllm serve`` picks it up once spectune is installed):

- ``plugin``: what is patched in vLLM's V1 model runner and rejection sampler, and why.
- ``step``: one verify step decided by spectune's rules, grouped by (rule, temperature), with the
  lossless fallback and its per-request ledger. No vLLM import: tested in the main environment.
- ``rules``: which rule decides: the engine's rule file and the rules requests carry.
- ``faults``: test-only fault injection the plugin reads when a test asks (off otherwise).
- ``host_syncs``: counts the device-to-host syncs a step would make on a GPU (a measuring tool).

Only this package imports ``vllm``, and only inside functions: every module here imports in an
environment without vLLM. It knows ``policies`` and the rest of ``workers``; never Ray, Optuna or MLflow.
"""
