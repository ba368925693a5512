"""Sampling parameters and the batched sampler.

:class:`SamplingParams` is validated when it is built, so a bad value raises before the
request reaches the engine. :func:`sample` turns a batch of logits into one token per row
on the device: greedy rows take the argmax; sampled rows divide by the temperature, keep
the top-k and then the top-p nucleus, and pick ``argmax(p / E)`` with ``E ~ Exp(1)`` drawn
from the row's own ``torch.Generator`` (the exponential race: token ``i`` wins with
probability ``p_i``). Nothing is read back to the host here; the caller reads the tokens
once per step.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

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


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


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


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """One token per row: int64 ``[rows]`` on the logits' device (no host read).

    ``logits``: float32 ``[rows, vocab]``. ``params[r]`` and ``generators[r]`` belong to
    row ``r``; greedy rows need no generator. Each sampled row draws exactly one vector of
    exponential noise from its generator, so a request's stream depends only on how many
    tokens it has sampled, never on the other requests of the batch.
    """
    rows = logits.shape[0]
    if len(params) != rows or len(generators) != rows:
        raise ValueError(f"params, generators: expected {rows} entries each, got {len(params)} and {len(generators)}")
    greedy = logits.argmax(dim=-1)
    sampled_rows = [r for r, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return greedy
    device = logits.device
    temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                               dtype=torch.float32, device=device)
    scaled = logits / temperature[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        scaled = _top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    noise = torch.ones_like(probs)
    for r in sampled_rows:
        gen = generators[r]
        if gen is None:
            raise ValueError(f"generators: row {r} samples (temperature > 0) but has no generator")
        noise[r].exponential_(generator=gen)
    is_greedy = torch.tensor([p.greedy for p in params], device=device)
    return torch.where(is_greedy, greedy, (probs / noise).argmax(dim=-1))
