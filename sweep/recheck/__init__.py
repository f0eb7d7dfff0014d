"""Re-deciding an exported results folder (``python -m jobs.results check``): every certificate recomputed
from the folder's evidence and the shipped ledger history, trusting nothing the folder records.

    from sweep.recheck.check import verify, recompute
    found = verify(Path("docs/results/<name>"))     # found.lines(), found.exit_code()

``check`` re-decides everything from the folder and the shipped ledger history (``--history``, default
``workers/results/known_attempts.jsonl``), trusting no recorded decision, threshold or skip, and prints one line
per check per budget, each ``ok``, ``FAILED: <why>`` or ``not checked: <why>`` (where the folder lacks what the
check needs); the exit code is 0 only when no check failed:

- ``steps``: every step of the budget's fixed sequence, gates included, from ``evidence/<candidate>.csv``: each
  step's bound at that budget's look plan and alpha (``sequential_bound``), passed, lost, won, n, look and p-value,
  and that the fixed sequence (``fixed_sequence``: stop at the first failure, the fastest that passed) stops
  where the certificate's steps stop and chooses its candidate; a certified flag the recomputation does not give
  fails (one withheld after the test, by the replay audit or an earlier decision, is said so);
- ``order``: the candidates' order, recomputed from the search figures the folder records (``frontier.json``'s
  trial rows: speed by the sweep's objective, drop, and the search bound again from lost / won / n, checked
  against the chosen files' ``search`` figures) with the sweep's own ``candidates_from`` and ``order_candidates``
  (safest first, ``--confirm-candidates`` of them), run through the fixed sequence on the evidence: it must test
  exactly the certificate's steps;
- ``design``: the look plan again from N, looks, alpha and the budget (``look_plan``), and those from
  ``sweep.json`` (alpha: ``--joint``'s share, and the family's level where the certificate names one);
- ``pool``: the evidence's items (and the attempt's) are the confirmation pool's first items in its fixed
  order, without the items the attempts before this one in the ledger history used or searched on (the skips
  come from the ledger, never from ``certification.json``'s ``pool.skipped``, which must agree with them);
- ``disjoint``: no evidence item is a search item, and ``search_items.txt`` is the sweep's search sample;
- ``audit``: the shown candidate's replay audit (``replay_check`` of ``chosen-budget-<b>.json``) is consistent in
  itself and with the evidence (which records were replayed, ``candidate_made``); a certificate's powered audit
  (``replay_check["audit"]``) is made again from the evidence CSV (``sweep.audit.audit_plan`` / ``audit_matches``:
  the same risk-chosen and drawn ids, m, N and seed, all decoded, at its power), and the cheap audit (a refusal's,
  or a certificate's made before the powered one) owes what ``sweep.audit`` owes (``AUDIT_MIN``, ``AUDIT_SHARE``);
  a certified budget must be one ``audit_withholds`` lets stand (no replayed record differing, nothing owed left
  undone);
- ``ledger``: the certificate's attempt has an ``opened`` row in the history for this benchmark and pair whose
  items start with every evidence file's items in order, and a ``decided`` row for the budget with the same
  certified flag;
- ``family``: a certificate made before the family (``workers.certify.family``: the k-th attempt on a benchmark and
  pair is tested at alpha x 2^-k) re-decided at the level its place in the ledger history gives it: the same steps
  on the look plan of that level must still certify (one that names its family was tested at it: ``design``);
- ``chosen``: ``chosen-budget-<b>.json`` (what Serve and ``jobs.export_rule`` read) is certification.json's entry;

and once per folder ``frontier``: a ``frontier.json`` with an empty lossless table (or no best lossless) fails.
A folder holding ``SUPERSEDED.md`` is reported as superseded (its checks printed for the record) and exits 3.

Its rooms: ``folder`` (the folder and the ledger history read once, the evidence CSVs, ``Finding`` and
``Verification``); ``decisions`` (design, steps, order, family: the fixed sequence again); ``items`` (pool,
disjoint, ledger, chosen and the folder's frontier); ``audit`` (the replay audit); ``check`` (``verify`` and
``recompute``: every check of a folder, in print order). This package's ``__init__`` imports none of its rooms,
so that they can import each other without a circle through it (tests/test_layering.py): import them by name.
"""
