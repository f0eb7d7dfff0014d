"""The sweep's search space, built from the policy registry's field metadata (rules never see
Optuna): one categorical ``family`` choice, each family's knobs as conditional parameters named
``<family>.<knob>``, and the draft length."""

from __future__ import annotations

from typing import Any

from policies import POLICIES, get_spec

DEFAULT_FAMILIES = ("dropmatch", "kl_judge", "top_k", "relaxed_topk", "typical", "target_entropy", "draft_entropy")


def check_families(families: list[str]) -> list[str]:
    for name in families:
        spec = get_spec(name)  # unknown: ValueError listing the valid names
        if spec.lossy and not spec.config_cls.search_space():
            raise ValueError(f"policy {name!r} has no search space (any_of: sweep its members instead)")
    if not families:
        raise ValueError("--policies must name at least one rule")
    return families


def suggest(trial: Any, families: list[str], draft_len: tuple[int, int]) -> tuple[str, dict[str, Any], int]:
    """Ask ``trial`` (an optuna Trial) for a family, its knobs and a draft length."""
    family = trial.suggest_categorical("family", families) if len(families) > 1 else families[0]
    params: dict[str, Any] = {}
    for knob, rng in POLICIES[family].config_cls.search_space().items():
        name = f"{family}.{knob}"
        if rng.choices is not None:
            params[knob] = trial.suggest_categorical(name, list(rng.choices))
        elif rng.integer:
            params[knob] = trial.suggest_int(name, int(rng.low), int(rng.high), log=rng.log)
        else:
            params[knob] = trial.suggest_float(name, float(rng.low), float(rng.high), log=rng.log)
    lo, hi = draft_len
    length = trial.suggest_int("draft_len", lo, hi) if hi > lo else lo
    return family, params, length


def decode_params(trial_params: dict[str, Any], families: list[str],
                  draft_len: tuple[int, int]) -> tuple[str, dict[str, Any], int]:
    """Inverse of ``suggest`` for a finished trial's ``params`` dict (a fixed draft length, one
    that was never a search parameter, comes from ``draft_len``)."""
    family = trial_params.get("family", families[0])
    prefix = f"{family}."
    params = {k[len(prefix):]: v for k, v in trial_params.items() if k.startswith(prefix)}
    return family, params, int(trial_params.get("draft_len", draft_len[0]))
