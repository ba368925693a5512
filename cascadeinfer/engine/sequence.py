"""A sequence: one sample of one request, with its tokens, pages and progress.

``tokens`` is the prompt followed by the generated tokens. ``num_computed`` counts the
leading tokens whose K/V are in the sequence's pages (shared prefix pages included); the
next step processes ``tokens[num_computed:]`` — the rest of the prompt (prefill, maybe in
chunks) or the one token sampled last (decode). After a preemption the sequence holds no
pages. Recomputed, its ``num_computed`` is 0: the next prefill recomputes prompt and
generated tokens alike. Swapped, ``swapped`` says where its pages wait on the host and
``num_computed`` stays. Either way generation continues exactly where it stopped.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from cascadeinfer.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from cascadeinfer.engine.detokenize import IncrementalText
    from cascadeinfer.engine.swap import SwappedPages


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Mutable state of one sample; the scheduler and the prefix cache own the updates.

    ``seq_id`` orders sequences by arrival (a request's ``n`` samples take consecutive
    ids), which decides admission order and which sequences are preempted first.
    """

    def __init__(
        self,
        seq_id: int,
        request_id: int,
        sample_index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int | None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.sample_index = sample_index
        self.prompt_len = len(prompt_token_ids)
        self.tokens = list(prompt_token_ids)
        self.params = params
        self.seed = seed  # of this sample's random stream (None: greedy)
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.num_computed = 0
        self.text: IncrementalText | None = None  # its updates' text, made by the first update
        self.pages: list[int] = []
        # Set while preempted by swapping: where its pages wait on the host (its
        # num_computed stays); see swap.py.
        self.swapped: SwappedPages | None = None
        self.forks: list[Sequence] = []  # samples 1..n-1, created when this one first samples
        # A beam whose next-token row is in, waiting for its siblings' (beam search decides
        # for all beams at once): nothing to compute, so it yields its pages first and is
        # not admitted again until the decision gives it a token.
        self.awaiting = False
        # Prefix-cache bookkeeping (see prefix_cache.py).
        self.page_hashes: list[bytes] = []  # hash chain of the full pages of `tokens`
        self.num_registered = 0  # leading full pages already offered to the cache
        self.pending_hashes: list[bytes] = []  # pages this sequence is computing for others

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_remaining(self) -> int:
        """Tokens not yet in the cache: the prompt's rest, or the last sampled token."""
        return len(self.tokens) - self.num_computed

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def is_decode(self) -> bool:
        return self.num_remaining == 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id}.{self.sample_index}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed}, pages={len(self.pages)})")
