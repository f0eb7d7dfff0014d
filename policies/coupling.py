"""The coupled sampler: Gumbel-max sampling with noise keyed by the item's seed and the absolute position.

At T > 0 the standard sampler draws each token from its own generator, so two arms of one item (target-only and
a rule) are two independent samples, and their paired outcomes disagree on most items by chance. The coupled
sampler draws the token at sequence position ``t`` as

    argmax_v  z_v / T + g_v(seed, t),     g_v ~ Gumbel(0, 1), independent over v,

which is a sample of softmax(z / T) (the Gumbel-max trick), with ``g`` a pure function of the seed and ``t``
(the counter hash of :mod:`policies.hashing`, salted apart from every rule's draws). Every arm uses the same ``g``
at the same position:

- target-only samples the target's token so;
- the draft proposes its own Gumbel-max token with the *same* noise (the coupling: the draft agrees with the
  target more often the closer their distributions are);
- ``lossless`` accepts a draft token exactly when it equals the target's Gumbel-max token there, and emits that
  token where it rejects (:func:`policies.lossless.lossless_accept`, :func:`policies.emission.emit_tokens`).

So lossless speculative decoding outputs, token for token, what target-only outputs for the same seed: at T > 0
as at T = 0, wherever the verify pass's logits equal a single step's bit for bit (the int8 path). A lossy rule is
then the only source of a difference between the arms. Its price: a coupled lossless rule accepts with
probability P(argmax(z_q/T + g) = argmax(z_p/T + g)), which lies in [(1 - TV) / (1 + TV), 1 - TV], below the
standard sampler's 1 - TV; speed is therefore timed with the standard sampler.

What carries over to the standard sampler: a rule that decides on (p, q) alone (the KL judge, the entropy rules)
emits, at each position given the prefix, the draft's token where it accepts and the lossless outcome where it
does not, under either sampler; each is a sample of the same law under both, so its output distribution is the
same. A rule that looks at the token drawn (top-k, relaxed top-k, typical, DropMatch, FLy's look-ahead) has no
such argument: its quality under the standard sampler is an empirical question.

The uniforms behind ``g`` carry 53 bits (one 64-bit hash per token), and the upper tail's ``1 - u`` is computed
without cancellation in float64, so the Gumbel tail reaches about 37 and the noise's resolution there stays fine: a
token far below the top is sampled at its own small chance, not at a grid's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from policies import fused
from policies.hashing import _M1, _mix, _signed
from policies.truncation import truncate

SAMPLERS = ("standard", "coupled")
_SALT = 0x436F75706C65644E  # "CoupledN": the coupling's draws never meet a rule's draws at the same seed


def check_sampler(sampler: object) -> str:
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    return str(sampler)


def item_seed(seed: int, item: str, turn: int = 0) -> int:
    """A generation's seed for the coupled sampler: ``seed``, the item's id and the turn hashed together, so no
    two items (nor two turns of one, nor seed s at turn 1 and seed s + 1 at turn 0) share noise at a position."""
    digest = hashlib.sha256(f"{int(seed)}\x00{item}\x00{int(turn)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 62) - 1)


def gumbel(seed: int, positions: Tensor, vocab: int) -> Tensor:
    """float32 ``[B, N, vocab]`` Gumbel(0, 1) noise; row ``b``'s slot ``n`` a pure function of ``seed`` and
    ``positions[b, n]`` (the same numbers in any batch, block or process)."""
    keys = _mix(positions.to(torch.int64) + _signed((int(seed) ^ _SALT) * _M1))  # one per (seed, position)
    return fused.gumbel_noise(keys.flatten(), int(vocab)).view(*positions.shape, int(vocab))


def perturbed_argmax(logits: Tensor, temperature: float, noise: Tensor) -> Tensor:
    """``argmax(logits / T + noise)`` over the last dimension (``noise`` at least as wide as ``logits``: the
    draft's narrower head reads the first ids' noise). -inf logits (a truncation's) stay out."""
    width = logits.shape[-1]
    return (logits.float() / temperature + noise[..., :width]).argmax(dim=-1)


class CoupledNoise:
    """One generation's noise, position by position: the draft's proposal at a position and the verify pass
    over it read the same numbers, each position's computed once and alone (a one-row block, so every arm builds
    it the same way) and held until :meth:`release` passes it."""

    def __init__(self, seed: int, vocab: int) -> None:
        self.seed, self.vocab = int(seed), int(vocab)
        self._held: dict[int, Tensor] = {}

    def at(self, positions: Sequence[int]) -> Tensor:
        """float32 ``[len(positions), vocab]``."""
        positions = [int(p) for p in positions]
        for p in positions:
            if p not in self._held:
                self._held[p] = gumbel(self.seed, torch.tensor([[p]]), self.vocab)[0, 0]
        return torch.stack([self._held[p] for p in positions])

    def release(self, below: int) -> None:
        """Drop the positions before ``below`` (committed: never asked for again)."""
        for p in [p for p in self._held if p < below]:
            del self._held[p]


@dataclass(frozen=True)
class CoupledDraw:
    """One generation's coupled draws as a whole (what a teacher-forced pass needs of the sampler): the temperature,
    the truncation and the generation's seed. Row ``i`` of ``logits`` at ``first + i`` is cut, then drawn with the
    noise of its absolute position, each position's built alone as :class:`CoupledNoise` builds it live."""

    temperature: float
    top_k: int
    top_p: float
    seed: int

    def __post_init__(self) -> None:
        if not self.temperature > 0.0:
            raise ValueError(f"the coupled sampler draws at T > 0, got T = {self.temperature}")

    def cut(self, logits: Tensor) -> Tensor:
        return truncate(logits, self.temperature, self.top_k, self.top_p)

    def noise(self, first: int, rows: int, vocab: int) -> Tensor:
        """float32 ``[rows, vocab]``: positions ``first .. first + rows - 1``."""
        return CoupledNoise(self.seed, vocab).at(range(int(first), int(first) + int(rows)))

    def tokens(self, cut_logits: Tensor, noise: Tensor) -> Tensor:
        """``[N]``: each row's draw from its cut logits ``[N, V']`` and its noise ``[N, >= V']``."""
        return perturbed_argmax(cut_logits, self.temperature, noise)
