"""A fast dtype's quality against its reference dtype (:mod:`jobs.bench.fast_quality`'s ``quality.json``) as the
markdown table ``quality.md``: written by the bench, rendered again from the figures by ``jobs.results check``."""

from __future__ import annotations


def render(summary: dict) -> str:
    s = summary
    return "\n".join([
        f"# The fast CPU path's quality: {s['fast']} against {s['reference']}", "",
        f"GSM8K test, the first {s['n']} items, {s['shots']}-shot, greedy target-only decoding, max_new_tokens "
        f"{s['max_new_tokens']}; pair {s['pair']}; machine {s['machine']}; {s['date']}.", "",
        "| | figure |", "|---|---:|",
        f"| accuracy, {s['reference']} | {s['accuracy_reference']:.3f} |",
        f"| accuracy, {s['fast']} | {s['accuracy_fast']:.3f} |",
        f"| paired drop ({s['reference']} − {s['fast']}) | {s['drop'] * 100:+.2f}% (lost {s['lost']}, won {s['won']}) |",
        f"| one-sided {100 * (1 - s['alpha']):g}% upper bound on the drop ({s['test']}) | {s['drop_upper_bound'] * 100:.2f}% |",
        f"| outputs identical token for token | {s['identical_outputs']} / {s['n']} |",
        f"| median first differing token, where they differ | {s['first_difference_median']} |",
        f"| {s['fast']} target-only speed | {s['fast_tokens_per_s']:.2f} tok/s |", "",
        f"n = {s['n']}. The bound is the exact unconditional test inverted (valid at every n); it describes the fast "
        "path and certifies no rule. Per-item evidence: `evidence.csv`.", ""])
