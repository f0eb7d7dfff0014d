"""The sweep's search space, built from the policy registry's field metadata (rules never see Optuna): one
categorical ``family`` choice, each family's knobs as conditional parameters named ``<family>.<knob>``, and the
draft length. ``search_ranges`` checks a config's ranges against what each rule accepts."""

from __future__ import annotations

from typing import Any

from policies import POLICIES, get_spec, make_policy

DEFAULT_FAMILIES = ("dropmatch", "kl_judge", "top_k", "relaxed_topk", "typical", "target_entropy", "draft_entropy",
                    "fly")


def check_families(families: list[str]) -> list[str]:
    for name in families:
        spec = get_spec(name)  # unknown: ValueError listing the valid names
        if spec.lossy and not spec.config_cls.search_space():
            raise ValueError(f"policy {name!r} has no search space (any_of: sweep its members instead)")
    if not families:
        raise ValueError("--policies must name at least one rule")
    return families


def search_ranges(families: list[str], overrides: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Each family's knob ranges: the rule's own (``search_space()``), with ``overrides`` (the sweep's
    ``--search-space``, a config file's ``search_space:`` block) in their place: ``{family: {knob: [low, high] | {low, high, log} | [choice, ...]}}``.
    ValueError naming the family, knob and problem (a range outside what the rule accepts, say)."""
    from dataclasses import replace

    ranges = {f: dict(POLICIES[f].config_cls.search_space()) for f in families}
    for family, knobs in (overrides or {}).items():
        if family not in ranges:
            raise ValueError(f"search_space: {family!r} is not among the searched --policies {families}")
        if not isinstance(knobs, dict):
            raise ValueError(f"search_space: {family}: expected a mapping of knob: range, got {knobs!r}")
        for knob, value in knobs.items():
            where = f"search_space: {family}.{knob}"
            if knob not in ranges[family]:
                raise ValueError(f"{where}: not a searched knob of {family}; valid: {sorted(ranges[family])}")
            base = ranges[family][knob]
            if base.choices is not None:
                choices = tuple(value) if isinstance(value, list | tuple) else ()
                if not choices or any(c not in base.choices for c in choices):
                    raise ValueError(f"{where}: a list drawn from {list(base.choices)}, got {value!r}")
                ranges[family][knob] = replace(base, choices=choices)
                continue
            if isinstance(value, list | tuple) and len(value) == 2:
                low, high, log = value[0], value[1], base.log
            elif isinstance(value, dict) and set(value) <= {"low", "high", "log"} and {"low", "high"} <= set(value):
                low, high, log = value["low"], value["high"], bool(value.get("log", base.log))
            else:
                raise ValueError(f"{where}: expected [low, high] or {{low, high, log}}, got {value!r}")
            if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high)) or not low < high:
                raise ValueError(f"{where}: need numbers low < high, got [{low!r}, {high!r}]")
            if base.integer and not (float(low).is_integer() and float(high).is_integer()):
                raise ValueError(f"{where}: an integer knob needs integer bounds, got [{low!r}, {high!r}]")
            if log and low <= 0:
                raise ValueError(f"{where}: a log range needs low > 0, got {low!r}")
            for v in (low, high):
                try:
                    make_policy(family, **{knob: int(v) if base.integer else float(v)})
                except ValueError as err:
                    raise ValueError(f"{where}: {v!r} is not a value {family} accepts ({err})") from None
            ranges[family][knob] = replace(base, low=low, high=high, log=log)
    return ranges


def suggest(trial: Any, families: list[str], draft_len: tuple[int, int],
            ranges: dict[str, dict[str, Any]] | None = None) -> tuple[str, dict[str, Any], int]:
    """Ask ``trial`` (an optuna Trial) for a family, its knobs (``ranges``: :func:`search_ranges`, default
    the rules' own) and a draft length. A rule that looks W positions ahead in its block (FLy) relaxes nothing
    at L <= W: its draft length is drawn first (2 or more where the range allows) and W below it."""
    family = trial.suggest_categorical("family", families) if len(families) > 1 else families[0]
    params: dict[str, Any] = {}
    space = (ranges or {}).get(family) or POLICIES[family].config_cls.search_space()
    lo, hi = draft_len
    ahead = POLICIES[family].lookahead_knob
    length = None
    if ahead is not None and ahead in space:  # L first (at least 2 where it can be), the window below it
        low = min(hi, max(lo, 2))
        length = trial.suggest_int("draft_len", low, hi) if hi > lo else lo
    for knob, rng in space.items():
        name = f"{family}.{knob}"
        if rng.choices is not None:
            params[knob] = trial.suggest_categorical(name, list(rng.choices))
        elif rng.integer:
            high = int(rng.high)
            if knob == ahead and length is not None:
                high = max(int(rng.low), min(high, length - 1))
            params[knob] = trial.suggest_int(name, int(rng.low), high, log=rng.log)
        else:
            params[knob] = trial.suggest_float(name, float(rng.low), float(rng.high), log=rng.log)
    if length is not None:
        return family, params, length
    return family, params, (trial.suggest_int("draft_len", lo, hi) if hi > lo else lo)


def decode_params(trial_params: dict[str, Any], families: list[str],
                  draft_len: tuple[int, int]) -> tuple[str, dict[str, Any], int]:
    """Inverse of ``suggest`` for a finished trial's ``params`` dict (a fixed draft length, one
    that was never a search parameter, comes from ``draft_len``)."""
    family = trial_params.get("family", families[0])
    prefix = f"{family}."
    params = {k[len(prefix):]: v for k, v in trial_params.items() if k.startswith(prefix)}
    return family, params, int(trial_params.get("draft_len", draft_len[0]))
