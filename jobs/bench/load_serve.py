"""Bounded load test of the Serve endpoint: the served (chosen) policy vs lossless vs target-only.

    # start the app here on the real pair with a chosen policy, then load it
    python -m jobs.bench.load_serve --clients 2 --seconds 90 -- --policy kl_judge --param threshold=0.5
    # or load a server that is already running
    python -m jobs.bench.load_serve --url http://127.0.0.1:8000 --clients 4 --seconds 60

N concurrent clients on loopback send GSM8K questions as streamed chat completions for T seconds
per phase, then stop issuing and wait for what is in flight (each request is bounded by
``--max-tokens``); the run ends by itself. Phases run one after another on the same server and
prompts: ``served`` (the server's own policy), ``lossless`` (same draft length, via the per-request
``spec_decode`` override) and ``off`` (target-only). Prints requests/s, p50/p99 latency, p50
time to first token, generated tokens/s, mean acceptance length, and the serving speedup of each
phase over ``off`` and ``lossless``; the 1-minute load average is recorded per phase. Writes the
raw per-request rows to ``runs/load/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import requests


@dataclass
class Sample:
    phase: str
    status: int
    latency_s: float
    ttft_s: float | None
    completion_tokens: int
    num_drafts: int
    error: str | None = None


def questions(n: int) -> list[str]:
    from workers.benchmarks import get_benchmark

    return [item.turns[0] for item in get_benchmark("gsm8k").items(limit=n)]


def one_request(url: str, model: str, prompt: str, max_tokens: int, spec: dict | None, phase: str) -> Sample:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if spec is not None:
        body["spec_decode"] = spec
    t0 = time.perf_counter()
    ttft, tokens, drafts = None, 0, 0
    try:
        with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=max_tokens * 5 + 60) as r:
            if r.status_code != 200:
                return Sample(phase, r.status_code, time.perf_counter() - t0, None, 0, 0, r.text[:200])
            for line in r.iter_lines(decode_unicode=True):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Sample(phase, 500, time.perf_counter() - t0, ttft, 0, 0, event["error"]["message"][:200])
                if ttft is None and event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                    ttft = time.perf_counter() - t0
                if "spec_decode" in event:
                    drafts = event["spec_decode"]["num_drafts"] or 0
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except requests.RequestException as err:
        return Sample(phase, 0, time.perf_counter() - t0, ttft, 0, 0, f"{type(err).__name__}: {err}"[:200])
    return Sample(phase, 200, time.perf_counter() - t0, ttft, tokens, drafts)


def run_phase(url: str, model: str, phase: str, spec: dict | None, prompts: list[str], clients: int, seconds: float,
              max_tokens: int) -> tuple[list[Sample], float, float]:
    """N clients for ``seconds``; returns samples, wall seconds (incl. drain) and the load average."""
    samples: list[Sample] = []
    lock = threading.Lock()
    counter = iter(range(10 ** 9))
    t_end = time.perf_counter() + seconds

    def client() -> None:
        while time.perf_counter() < t_end:
            with lock:
                i = next(counter)
            s = one_request(url, model, prompts[i % len(prompts)], max_tokens, spec, phase)
            with lock:
                samples.append(s)
                ok = sum(x.status == 200 for x in samples)
            print(f"  {phase}: {ok} ok / {len(samples)} done | last {s.latency_s:.1f}s {s.completion_tokens} tok",
                  file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return samples, time.perf_counter() - t0, os.getloadavg()[0]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def summarize(phases: dict[str, dict[str, Any]]) -> str:
    """One row per (clients, phase); speedups against ``off``/``lossless`` at the same concurrency, and
    aggregate tokens/s against the same phase at the fewest clients (what concurrency buys)."""
    rows = {}
    for name, ph in phases.items():
        ok = [s for s in ph["samples"] if s.status == 200]
        tokens = sum(s.completion_tokens for s in ok)
        drafts = sum(s.num_drafts for s in ok)
        rows[name] = {
            "requests": len(ok), "errors": len(ph["samples"]) - len(ok), "rps": len(ok) / ph["wall_s"],
            "p50": pct([s.latency_s for s in ok], 0.5), "p99": pct([s.latency_s for s in ok], 0.99),
            "ttft": pct([s.ttft_s for s in ok if s.ttft_s is not None], 0.5),
            "ttft99": pct([s.ttft_s for s in ok if s.ttft_s is not None], 0.99),
            "tok_s": tokens / ph["wall_s"], "mal": tokens / drafts if drafts else float("nan"), "load": ph["load"],
        }
    lines = ["| clients | phase | policy | requests ok (errors) | req/s | p50 latency s | p99 latency s | p50 TTFT s | "
             "p99 TTFT s | tokens/s | vs fewest clients | mean acc. len | speedup vs off | vs lossless | load(1m) |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fewest = min(ph["clients"] for ph in phases.values()) if phases else 1

    def vs(r: dict, base: str | None) -> str:
        return f"{r['tok_s'] / rows[base]['tok_s']:.2f}x" if base in rows and rows[base]["tok_s"] else "—"

    for name, r in rows.items():
        ph = phases[name]
        at = (lambda phase, c=ph["clients"]: next((k for k, p in phases.items()  # noqa: E731
                                                   if p["phase"] == phase and p["clients"] == c), None))
        c = ph["clients"]
        base = next((k for k, p in phases.items() if p["phase"] == ph["phase"] and p["clients"] == fewest), None) \
            if c != fewest else None
        lines.append(f"| {c} | {ph['phase']} | {ph['label']} | {r['requests']} ({r['errors']}) | {r['rps']:.3f} | "
                     f"{r['p50']:.1f} | {r['p99']:.1f} | {r['ttft']:.2f} | {r['ttft99']:.2f} | {r['tok_s']:.2f} | "
                     f"{vs(r, base)} | {'—' if r['mal'] != r['mal'] else format(r['mal'], '.2f')} | "
                     f"{vs(r, at('off'))} | {vs(r, at('lossless'))} | {r['load']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (default: start one here with the flags after --)")
    ap.add_argument("--clients", default="2", help="concurrent clients; a comma list (1,4,8) runs each in turn")
    ap.add_argument("--seconds", type=float, default=60, help="issuing time per phase")
    ap.add_argument("--max-tokens", type=int, default=96, help="max_tokens per request")
    ap.add_argument("--prompts", type=int, default=32, help="GSM8K questions cycled through")
    ap.add_argument("--phases", default="served,lossless,off", help="comma list of served, lossless, off")
    ap.add_argument("--out", default="runs/load", help="directory for the raw rows")
    args = ap.parse_args(own)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    try:
        counts = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or args.seconds <= 0 or args.max_tokens < 1 or not phases or set(phases) - {"served", "lossless", "off"}:
        ap.error("--clients/--max-tokens >= 1, --seconds > 0, --phases from served,lossless,off")
    url = args.url
    if url is None:
        from jobs import serve

        sargs = serve.build_parser().parse_args(serve_args)
        try:
            settings = serve.settings_from(serve.args_to_spec(sargs))
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"starting the app ({settings.pair}, {settings.policy} {settings.params} L={settings.draft_len})",
              file=sys.stderr, flush=True)
        url = serve.start(settings, sargs.host, sargs.port, sargs.address)
    deadline = time.time() + (30 if args.url else 900)  # a server started here may still be loading its pair
    while True:
        try:
            policy = requests.get(f"{url}/v1/policy", timeout=10).json()
            break
        except (requests.RequestException, ValueError):
            if time.time() > deadline:
                print(f"error: {url} did not answer /v1/policy", file=sys.stderr)
                return 2
            time.sleep(2)
    model, draft_len = policy["model"], policy["draft_len"] or 5
    specs = {"served": None, "lossless": {"policy": "lossless", "draft_len": draft_len}, "off": {"enabled": False}}
    labels = {"served": f"{policy['policy']} {json.dumps(policy['params'])} L={policy['draft_len']}",
              "lossless": f"lossless L={draft_len}", "off": "target-only"}
    prompts = questions(args.prompts)
    one_request(url, model, prompts[0], 4, None, "warm-up")
    results: dict[str, dict[str, Any]] = {}
    for clients in counts:
        for name in phases:
            print(f"phase {name}: {clients} clients x {args.seconds:.0f}s", file=sys.stderr, flush=True)
            samples, wall, load = run_phase(url, model, name, specs[name], prompts, clients, args.seconds,
                                            args.max_tokens)
            results[f"{name}@{clients}"] = {"samples": samples, "wall_s": wall, "load": load, "label": labels[name],
                                            "phase": name, "clients": clients}
    table = summarize(results)
    head = (f"{policy['pair']} {policy['dtype']}, served policy {labels['served']} (source: {policy['source'].get('kind')}), "
            f"{args.clients} clients x {args.seconds:.0f}s per phase, streamed chat, greedy, max_tokens "
            f"{args.max_tokens}, {os.cpu_count()} CPUs")
    print(head + "\n\n" + table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"load-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"head": head, "table": table, "policy": policy, "args": vars(args),
                                "phases": {k: {**v, "samples": [asdict(s) for s in v["samples"]]}
                                           for k, v in results.items()}}, indent=1, default=str))
    print(f"\nraw rows: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
