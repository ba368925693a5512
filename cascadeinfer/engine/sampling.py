"""Sampling parameters and the batched sampler.

:class:`SamplingParams` is validated when it is built, so a bad value raises before the
request reaches the engine. :func:`sample` turns a batch of logits into one token per row
on the device, with no per-row device work: greedy rows take the argmax; sampled rows
divide by the temperature, keep the top-k and then the top-p nucleus, and invert the
row's cumulative distribution at one uniform number ``u`` (token ``i`` wins with
probability ``p_i``). ``u`` is a counter-based function of the row's seed and of how many
tokens the row has sampled (:func:`sample_uniforms`, SplitMix64), computed for the whole
batch at once on the host: a request's stream depends only on its seed and its progress,
never on the other requests of the batch, on preemption or on the device. Nothing is read
back to the host here; the caller reads the tokens once per step.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def _int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got a bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite float, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the tokens of one request.

    Attributes:
        n: independent samples of the prompt (>= 1). They share the prompt's KV pages
            (fork, then copy-on-write of the last page).
        temperature: 0 is greedy; otherwise logits are divided by it (> 0).
        top_k: keep the k most likely tokens; 0 (or -1) keeps all.
        top_p: keep the smallest set of most likely tokens whose probability is at least
            ``top_p``, in ``(0, 1]``; 1 keeps all. Applied after top-k.
        max_tokens: new tokens to generate at most (>= 1).
        seed: seed of this request's random stream; sample ``i`` of ``n`` uses a stream
            derived from ``(seed, i)`` (``seed`` itself for ``i = 0``). None: the engine
            derives one from its own seed and the request's number, so runs repeat.
        stop_token_ids: generation stops after any of these (the token is kept in the
            output).
        ignore_eos: do not stop at the model's end-of-sequence tokens.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # normalising a frozen dataclass in its own constructor
        set_(self, "n", _int("n", self.n, 1))
        temperature = _float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature: expected >= 0 (0 is greedy), got {temperature}")
        set_(self, "temperature", temperature)
        top_k = _int("top_k", self.top_k, -1)
        set_(self, "top_k", 0 if top_k == -1 else top_k)
        top_p = _float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p: expected a value in (0, 1], got {top_p}")
        set_(self, "top_p", top_p)
        set_(self, "max_tokens", _int("max_tokens", self.max_tokens, 1))
        if self.seed is not None:
            seed = _int("seed", self.seed, 0)
            if seed >= 2**63:
                raise ValueError(f"seed: expected a value below 2**63, got {seed}")
            set_(self, "seed", seed)
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise TypeError(f"stop_token_ids: expected a sequence of ints, got {type(self.stop_token_ids).__name__}")
        set_(self, "stop_token_ids",
             tuple(_int(f"stop_token_ids[{i}]", t, 0) for i, t in enumerate(self.stop_token_ids)))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos: expected a bool, got {type(self.ignore_eos).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads consecutive indices apart


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed`` (``seed`` for index 0)."""
    return (seed + index * _GOLDEN) % 2**63


_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of uint64 that scatters nearby inputs."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def sample_uniforms(seeds: Sequence[int], steps: Sequence[int]) -> torch.Tensor:
    """float64 ``[rows]`` in ``[0, 1)``: draw number ``steps[r]`` of the stream ``seeds[r]``.

    A SplitMix64 stream whose state starts at the mixed seed: draw ``t`` is
    ``mix(mix(seed) + (t + 1) * golden)``, its top 53 bits making the float. Mixing the
    seed first keeps the streams of ``sample_seed(seed, k)`` (seeds a multiple of the
    golden constant apart) from being shifted copies of one another. Vectorised in numpy
    uint64, whose arithmetic wraps modulo 2**64 as the generator needs. Seeds are below
    2**63, steps >= 0.
    """
    seeds = np.asarray(seeds, dtype=np.uint64).reshape(-1)
    steps = np.asarray(steps, dtype=np.uint64).reshape(-1)
    z = _mix64(_mix64(seeds) + (steps + np.uint64(1)) * np.uint64(_GOLDEN))
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * 2.0**-53)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k, then outside its top-p nucleus.

    ``logits``: float32 ``[rows, vocab]``; ``top_k``: int64 ``[rows]`` (0 = all);
    ``top_p``: float32 ``[rows]`` in (0, 1]. The most likely token always survives.
    """
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ordered = ordered.masked_fill(rank[None, :] >= k[:, None], -math.inf)
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    outside = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # rounding never trims p = 1
    ordered = ordered.masked_fill(outside, -math.inf)
    return torch.full_like(logits, -math.inf).scatter(-1, order, ordered)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """int64 ``[rows]``: the first token whose cumulative probability exceeds ``u * total``
    (``probs`` float32 ``[rows, vocab]``, ``u`` ``[rows]`` in ``[0, 1)``).

    A token of probability 0 spans an empty interval of the CDF, so it is chosen only if
    the target reaches the total. It never does: ``u`` is capped at the largest float32
    below 1, and ``(1 - 2**-24) * total`` rounds below ``total`` for any positive float32
    total. The float32 CDF resolves probabilities down to about 1e-7 of the total.
    """
    cdf = probs.cumsum(dim=-1)
    u = u.to(torch.float32).clamp_(max=1.0 - 2.0**-24)  # float32(1 - 2**-53) would be 1
    target = (u * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int | None],
    steps: Sequence[int],
) -> torch.Tensor:
    """One token per row: int64 ``[rows]`` on the logits' device (no host read).

    ``logits``: ``[rows, vocab]``, float32 or the model's fp16 / bf16 (greedy rows take
    the argmax of the values as given, which a float32 cast would not change; sampled rows
    are scaled and normalised in float32). ``params[r]``, ``seeds[r]`` and ``steps[r]``
    belong to row ``r``: its sampling parameters, the seed of its stream (greedy rows
    need none) and how many tokens it has sampled before (the position in its stream).
    Per-row values travel to the device in one copy; the device work is the same few
    batched operations whatever the mix of greedy, temperature, top-k and top-p rows.
    """
    rows = logits.shape[0]
    if len(params) != rows or len(seeds) != rows or len(steps) != rows:
        raise ValueError(f"params, seeds, steps: expected {rows} entries each, "
                         f"got {len(params)}, {len(seeds)} and {len(steps)}")
    greedy = logits.argmax(dim=-1)
    sampled_rows = [r for r, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return greedy
    for r in sampled_rows:
        if seeds[r] is None:
            raise ValueError(f"seeds: row {r} samples (temperature > 0) but has no seed")
    # One host tensor, one copy: temperature (0 = greedy), top_k, top_p, u.
    host = torch.empty(rows, 4, dtype=torch.float64)
    host[:, :3] = torch.tensor([(p.temperature, p.top_k, p.top_p) for p in params], dtype=torch.float64)
    host[:, 3] = sample_uniforms([0 if s is None else s for s in seeds], steps)
    per_row = host.to(logits.device, non_blocking=True)
    temperature = per_row[:, 0].float()
    logits = logits.float()  # a no-op for float32 logits
    is_greedy = temperature == 0
    scaled = logits / torch.where(is_greedy, 1.0, temperature)[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        scaled = _top_k_top_p(scaled, per_row[:, 1].long(), per_row[:, 2].float())
    drawn = _inverse_cdf(scaled.softmax(dim=-1), per_row[:, 3])
    return torch.where(is_greedy, greedy, drawn)
