"""What a sweep's certificate covers, and whether a rule served or exported from it still runs inside that.

A certificate bounds the accuracy drop of one rule decoded under the conditions its confirmation ran: the
pair, the dtype, the draft length, the drafter (the pair's draft model: sweeps never draft with an EAGLE
head), the benchmark and its decoding settings (temperature, shots, max new tokens), the engine. ``jobs.serve``
and ``jobs.export_rule`` may change all but the benchmark's (the engine where the choice records it: files
from before it was recorded say nothing of theirs). An override that changes one of them leaves the
certificate behind: the rule is then refused unless the caller passes ``--allow-uncertified``, and where
it is allowed it is reported ``certified: false`` with the changes named (``outside_certificate``). A
request at another temperature cannot be refused ahead of time; each response says whether it ran inside
the certificate (:func:`ran_inside`, which the Serve endpoint asks per request).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DRAFTER = "draft_model"  # what every sweep drafts with


def covers(choice: dict[str, Any]) -> dict[str, Any]:
    """The conditions a chosen file's certificate was made under (what it records; older files lack the engine)."""
    decode = choice.get("decode") or {}
    out = {"benchmark": choice.get("benchmark"), "pair": choice.get("pair"), "dtype": choice.get("dtype"),
           "draft_len": choice.get("draft_len"), "drafter": DRAFTER, "engine": choice.get("engine"),
           "temperature": decode.get("temperature"), "top_k": decode.get("top_k"), "top_p": decode.get("top_p"),
           "shots": decode.get("shots"), "max_new_tokens": decode.get("max_new_tokens"),
           "sampler": decode.get("sampler")}
    if decode.get("sampler") == "coupled":
        out["transfers_to_standard"] = _transfers(choice)
    return {k: v for k, v in out.items() if v is not None}


def _transfers(choice: dict[str, Any]) -> bool:
    """Whether a certificate made under the coupled sampler covers the standard one, which a deployment samples
    with: by argument for a rule that decides on the two distributions alone (``policies.Traits``'s
    ``decides_on_distributions``), for no other (an equivalence test would have to show it)."""
    from policies import make_policy, traits

    try:
        return bool(traits(make_policy(str(choice.get("policy")), **(choice.get("params") or {})))
                    .decides_on_distributions)
    except (ValueError, TypeError, KeyError):
        return False


def withdrawn(*folders: Path) -> tuple[str, Path] | None:
    """The first line of the ``SUPERSEDED.md`` that withdraws a folder's certificates (a results folder, a
    sweep's run directory) and where it is, for the first of ``folders`` that holds one; None if none does."""
    for folder in folders:
        note = Path(folder) / "SUPERSEDED.md"
        if note.is_file():
            return (note.read_text().strip().splitlines() or ["superseded"])[0].lstrip("# ").strip(), note
    return None


def _pair_dirs(pair: Any, cache_dir: str | None) -> tuple[Path, Path] | None:
    """A pair's two model directories, resolved; None where it cannot be resolved here (an unknown name, a
    shipped pair not fetched on this machine)."""
    if isinstance(pair, (tuple, list)) and len(pair) == 2:
        return Path(pair[0]).resolve(), Path(pair[1]).resolve()
    from workers.cli import InputError
    from workers.models.pair import pair_dirs

    try:
        draft, target, _ = pair_dirs(str(pair), cache_dir)
    except (ValueError, OSError, InputError):
        return None
    return Path(draft).resolve(), Path(target).resolve()


def same_pair(certified: Any, used: Any, fingerprint: str | None = None, cache_dir: str | None = None) -> bool:
    """Whether ``used`` (a pair name, ``DRAFT+TARGET``, or two directories) names the certified pair: the
    same text; the same fingerprint where the choice records the pair's (what the certificate ledger keys
    on, ``workers.models.identity``: a copy of the same weights is the same pair); the same two directories
    once resolved. What cannot be resolved here is not the same pair."""
    if certified is None or used is None or str(certified) == str(used):
        return True
    if fingerprint:
        from workers.cli import InputError
        from workers.models.identity import pair_fingerprint

        text = "+".join(str(p) for p in used) if isinstance(used, (tuple, list)) else str(used)
        try:
            if pair_fingerprint(text) == fingerprint:
                return True
        except (ValueError, OSError, InputError):
            pass
    a, b = _pair_dirs(certified, cache_dir), _pair_dirs(used, cache_dir)
    return a is not None and a == b


def same_dtype(a: str, b: str) -> bool:
    """bf16 and bfloat16 (any case, a ``torch.`` prefix) are one dtype; what no table knows compares as text."""
    from workers.models.pair import resolve_dtype

    try:
        return resolve_dtype(a) == resolve_dtype(b)
    except ValueError:
        return str(a) == str(b)


def changes(choice: dict[str, Any], *, pair: Any = None, dtype: str | None = None, draft_len: int | None = None,
            drafter: str | None = None, engine: str | None = None, cache_dir: str | None = None) -> list[str]:
    """What the given settings change of the conditions the choice was certified under, one phrase each
    (empty: inside them). A setting left None is the choice's own. A deployment samples with the standard sampler:
    a certificate made under the coupled one covers it only for a rule whose quality carries over (:func:`covers`)."""
    out = []
    if (choice.get("decode") or {}).get("sampler") == "coupled" and not _transfers(choice):
        out.append("the standard sampler (certified under the coupled sampler, and this rule looks at the token "
                   "drawn: its quality under the standard sampler is not shown)")
    if pair is not None and not same_pair(choice.get("pair"), pair, choice.get("pair_fingerprint"), cache_dir):
        shown = "+".join(str(p) for p in pair) if isinstance(pair, (tuple, list)) else str(pair)
        out.append(f"pair {shown} (certified: {choice.get('pair')})")
    if dtype is not None and choice.get("dtype") is not None and not same_dtype(dtype, choice["dtype"]):
        out.append(f"dtype {dtype} (certified: {choice['dtype']})")
    if draft_len is not None and choice.get("draft_len") is not None and int(draft_len) != int(choice["draft_len"]):
        out.append(f"draft length {draft_len} (certified: {choice['draft_len']})")
    if drafter is not None and drafter != DRAFTER:
        out.append(f"drafter {drafter} (certified: the pair's draft model)")
    if engine is not None and choice.get("engine") is not None and engine != choice["engine"]:
        out.append(f"engine {engine} (certified: {choice['engine']}; its kernels and numerics differ)")
    return out


def check_scope(choice: dict[str, Any], what: str, found: list[str], allow_uncertified: bool) -> dict[str, Any]:
    """The source fields for a certified choice used with the changes ``found``: nothing to add when there
    are none (or the choice was not certified anyway); ``certified: false`` and the changes when the caller
    allows it; else a ValueError naming each change and the ways out."""
    if not found or choice.get("certified") is not True:
        return {}
    if not allow_uncertified:
        raise ValueError(f"{what} is certified for {_conditions(choice)}, and this changes {'; '.join(found)}: "
                         "its certificate does not cover that. Use the certified settings, certify these with a "
                         "sweep, or pass --allow-uncertified")
    return {"certified": False, "outside_certificate": found}


def ran_inside(source: dict[str, Any], same_rule: bool, temperature: float, top_k: int = 0,
               top_p: float = 1.0) -> bool:
    """Whether a request ran inside the served rule's certificate: the served rule is certified and served
    within what its certificate covers (``source``, from ``jobs.serve``), the request ran that rule
    (``same_rule``), and at the temperature the certificate was made at (unknown: not inside), and, at T > 0,
    with its top-k and top-p (a certificate that records none was made on the whole distribution) and, where it
    was made under the coupled sampler, for a rule whose quality carries over to the standard sampler every
    request here draws with (``transfers_to_standard``). Its prompts
    are another matter: a certificate bounds the drop on its benchmark's items, not on whatever a client sends."""
    if source.get("certified") is not True or not same_rule:
        return False
    covered = source.get("covers") or {}
    certified_at = covered.get("temperature")
    known = isinstance(certified_at, (int, float)) and not isinstance(certified_at, bool)  # a hand-edited file's
    if not known or abs(temperature - float(certified_at)) > 1e-6:
        return False
    if temperature == 0.0:  # greedy: the argmax, which every truncation keeps
        return True
    if covered.get("sampler", "standard") != "standard" and covered.get("transfers_to_standard") is not True:
        return False
    return int(covered.get("top_k") or 0) == top_k and abs(float(covered.get("top_p") or 1.0) - top_p) <= 1e-9


def _conditions(choice: dict[str, Any]) -> str:
    c = covers(choice)
    parts = [f"{k} {c[k]}" for k in ("pair", "dtype", "draft_len") if k in c] + ["the pair's draft model"]
    return ", ".join(parts + ([f"the {c['engine']} engine"] if "engine" in c else []))
