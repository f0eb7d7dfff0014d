"""Scorers a task file names (``scorer:``): one small registry, each a function of (output, reference, row).

- ``exact``: the output, stripped, equals the reference, stripped.
- ``numeric``: the final number of the output (GSM8K's extractor: ``\\boxed{}``, "The answer is N",
  "#### N", else the last number; commas, ``$`` and units tolerated) equals the reference's number.
- ``regex:<pattern>``: the last match of ``pattern`` in the output (its first group if it has one),
  stripped, equals the reference, stripped.
- ``code``: the output's code (a fenced block if there is one) followed by the reference (test code that
  raises on failure) runs in the sandbox (``workers.benchmarks.sandbox``); passed = exit 0.
- ``similarity``: cosine similarity of the output and the reference under the pinned embedding model
  (``workers.benchmarks.similarity``), a score in [0, 1].
- ``python:<module>:<function>``: ``function(output, reference, row)`` returns a float in [0, 1], a
  (float, reason) pair or a ``Score``.
- ``judge``: an LLM judge behind an OpenAI-compatible endpoint rates the output (``judge:`` block of the
  task file: ``url``, ``model``, ``rubric``, ``scale``; ``SPECTUNE_JUDGE_URL`` / ``--judge-url`` overrides
  the url). Greedy, retried on connection errors and 5xx with backoff, answers cached on disk by
  (model, prompt), so a rerun or the other arm's identical output never asks twice. The rating is the
  last ``[[N]]`` (or "Rating: N") of the reply, divided by ``scale``; a reply without one scores 0 with
  the reply kept in the score's details.

Knows nothing about models, Ray or MLflow.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any

from workers.benchmarks.base import Score

Scorer = Callable[[str, Any, dict], Score]
NAMES = ("exact", "numeric", "regex:<pattern>", "code", "similarity", "python:<module>:<function>", "judge")
DEFAULT_RUBRIC = (
    "Please act as an impartial judge and evaluate the quality of the response provided by an AI assistant to "
    "the user question displayed below, compared with the reference answer. Identify any mistakes. Be as "
    "objective as possible. After your explanation, rate the response on a scale of 1 to {scale} by strictly "
    "following this format: \"[[rating]]\", for example: \"Rating: [[5]]\".\n\n[Question]\n{prompt}\n\n"
    "[Reference Answer]\n{reference}\n\n[Assistant's Answer]\n{output}")
_RATING = re.compile(r"\[\[\s*(\d+(?:\.\d+)?)\s*\]\]|[Rr]ating:\s*(\d+(?:\.\d+)?)")
_FENCE = re.compile(r"```(?:[A-Za-z0-9_+-]*)\n(.*?)```", re.DOTALL)


def _exact(output: str, reference: Any, row: dict) -> Score:
    got, want = output.strip(), str(reference).strip()
    ok = got == want
    return Score(1.0 if ok else 0.0, got, "exact match" if ok else f"mismatch, reference {want[:80]!r}")


def _numeric(output: str, reference: Any, row: dict) -> Score:
    from workers.benchmarks.gsm8k import extract_number, to_decimal

    want_text, _ = extract_number(str(reference))
    want = None if want_text is None else to_decimal(want_text)
    if want is None:
        return Score(0.0, None, f"the reference {str(reference)[:80]!r} holds no number", {"gold": None})
    got_text, rule = extract_number(output)
    if got_text is None:
        return Score(0.0, None, rule, {"gold": want_text, "rule": rule})
    got = to_decimal(got_text)
    ok = got is not None and got == want
    reason = f"{'exact match' if ok else 'mismatch'} {got_text} ({rule})" + ("" if ok else f", gold {want_text}")
    return Score(1.0 if ok else 0.0, got_text, reason, {"gold": want_text, "rule": rule})


def _regex(pattern: str) -> Scorer:
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise ValueError(f"scorer regex:{pattern!r} is not a valid regular expression: {err}") from None

    def score(output: str, reference: Any, row: dict) -> Score:
        matches = list(compiled.finditer(output))
        if not matches:
            return Score(0.0, None, f"no match for {pattern!r}")
        last = matches[-1]
        got = (last.group(1) if compiled.groups else last.group(0)).strip()
        want = str(reference).strip()
        ok = got == want
        return Score(1.0 if ok else 0.0, got, "exact match" if ok else f"mismatch {got!r}, reference {want[:80]!r}")

    return score


def _code(output: str, reference: Any, row: dict) -> Score:
    from workers.benchmarks.sandbox import run_python

    blocks = _FENCE.findall(output)
    code = blocks[-1] if blocks else output
    res = run_python(f"{code}\n\n{reference}\n")
    reason = "passed" if res.passed else (res.reason if res.status == "timeout" else f"test failed: {res.reason}")
    return Score(1.0 if res.passed else 0.0, code, reason, {"status": res.status, "returncode": res.returncode,
                                                           "stderr_tail": res.stderr_tail[-2000:]})


def _similarity(output: str, reference: Any, row: dict) -> Score:
    from workers.benchmarks.similarity import similarity

    value = min(max(float(similarity(output, str(reference))), 0.0), 1.0)
    return Score(value, None, f"similarity {value:.3f}")


def _python(target: str) -> Scorer:
    module_name, _, function_name = target.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"scorer python:{target!r} must be python:<module>:<function>")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"scorer python:{target}: cannot import {function_name!r} from {module_name!r} ({err})") from None

    def score(output: str, reference: Any, row: dict) -> Score:
        got = function(output, reference, row)
        if isinstance(got, Score):
            value, result = got.score, got
        else:
            value, why = (got if isinstance(got, tuple) else (got, ""))
            result = Score(float(value), None, str(why) or f"{function_name} = {float(value):g}")
        if not (isinstance(value, int | float) and math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(f"scorer python:{target} returned {value!r}: a score must be a number in [0, 1]")
        return result

    return score


def judge_cache_dir() -> os.PathLike[str] | str:
    from workers.models.assets import cache_root

    return os.environ.get("SPECTUNE_JUDGE_CACHE") or os.path.join(cache_root(), "judge")


def _post(url: str, body: dict, timeout_s: float, retries: int) -> dict:
    """POST JSON, retried with backoff on connection errors, timeouts and 5xx; a 4xx is a configuration
    error (an unknown model, say) and raises at once."""
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode()
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(min(8.0, 0.5 * 2 ** (attempt - 1)))
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return json.loads(resp.read().decode())
        except urllib.error.HTTPError as err:
            text = err.read().decode(errors="replace")[:300]
            if err.code < 500:
                raise ValueError(f"judge at {url} refused the request: HTTP {err.code}: {text}") from None
            last = f"HTTP {err.code}: {text}"
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
            last = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
    raise RuntimeError(f"judge at {url} failed {retries + 1} times; last: {last}")


def _judge(config: dict[str, Any] | None) -> Scorer:
    config = dict(config or {})
    unknown = sorted(set(config) - {"url", "model", "rubric", "scale", "retries", "timeout_s", "max_tokens"})
    if unknown:
        raise ValueError(f"judge: unknown key {unknown[0]!r}; valid: url, model, rubric, scale, retries, timeout_s, max_tokens")
    url = os.environ.get("SPECTUNE_JUDGE_URL") or config.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError("judge: needs the endpoint's base url (judge.url in the task file, or --judge-url / "
                         f"SPECTUNE_JUDGE_URL), e.g. http://127.0.0.1:8000/v1; got {url!r}")
    model = config.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError(f"judge: needs judge.model (the served model's name), got {model!r}")
    rubric = config.get("rubric", DEFAULT_RUBRIC)
    if not isinstance(rubric, str) or "{output}" not in rubric:
        raise ValueError("judge: judge.rubric must be a format string containing {output}")
    scale = config.get("scale", 10)
    if not isinstance(scale, int | float) or isinstance(scale, bool) or scale <= 0:
        raise ValueError(f"judge: judge.scale must be a number > 0, got {scale!r}")
    retries, timeout_s = int(config.get("retries", 3)), float(config.get("timeout_s", 120))
    max_tokens = int(config.get("max_tokens", 512))
    endpoint = url.rstrip("/") + "/chat/completions"

    def score(output: str, reference: Any, row: dict) -> Score:
        fields = {**row, "reference": reference, "output": output, "scale": scale}
        fields.setdefault("prompt", "")
        try:
            prompt = rubric.format(**fields)
        except KeyError as err:
            raise ValueError(f"judge: judge.rubric names {err.args[0]!r}, which is neither a field of the data nor "
                             "one of prompt, reference, output, scale") from None
        key = hashlib.sha256(json.dumps([model, prompt, max_tokens]).encode()).hexdigest()
        path = os.path.join(judge_cache_dir(), key[:2], f"{key}.json")
        cached = os.path.isfile(path)
        if cached:
            with open(path) as f:
                reply = json.load(f)["reply"]
        else:
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0.0,
                    "max_tokens": max_tokens}
            got = _post(endpoint, body, timeout_s, retries)
            try:
                reply = got["choices"][0]["message"]["content"] or ""
            except (KeyError, IndexError, TypeError):
                raise RuntimeError(f"judge at {endpoint} answered without choices[0].message.content: "
                                   f"{json.dumps(got)[:200]}") from None
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump({"model": model, "prompt": prompt, "reply": reply}, f)
            os.replace(tmp, path)  # whole or absent, even with several actors writing
        found = [a or b for a, b in _RATING.findall(reply)]
        details = {"reply": reply[-1000:], "cached": cached, "model": model}
        if not found:
            return Score(0.0, None, "no rating in the judge's reply", details)
        rating = float(found[-1])
        value = min(max(rating / float(scale), 0.0), 1.0)
        return Score(value, found[-1], f"judge rating {found[-1]}/{scale:g}", details)

    return score


FIXED: dict[str, Scorer] = {"exact": _exact, "numeric": _numeric, "code": _code, "similarity": _similarity}


def make_scorer(spec: str, judge: dict[str, Any] | None = None) -> Scorer:
    """The scorer a task file's ``scorer:`` names (``judge``: its ``judge:`` block); ValueError listing the
    valid names otherwise."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"scorer must be one of {', '.join(NAMES)}, got {spec!r}")
    if spec in FIXED:
        return FIXED[spec]
    if spec == "judge":
        return _judge(judge)
    kind, _, rest = spec.partition(":")
    if kind == "regex" and rest:
        return _regex(rest)
    if kind == "python" and rest:
        return _python(rest)
    raise ValueError(f"unknown scorer {spec!r}; valid: {', '.join(NAMES)}")
