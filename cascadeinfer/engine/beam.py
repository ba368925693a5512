"""Beam search for one request, decided on the host as transformers decides it.

The engine runs the beams as ordinary sequences: they share the prompt's pages and their
common generated pages (the scheduler's fork, copy-on-write on the last page), a pruned
beam frees its pages, and each decode step groups the beams into cascade levels like any
other rows. What to keep is decided here, per step, from the beams' log-probabilities:
the same arithmetic as transformers' ``generate(num_beams=k, do_sample=False)``
(``_beam_search``, or its greedy search for ``k = 1``: top ``2k`` continuations of the
running beams' cumulative
log-probabilities, those ending in a stop token among the first ``k`` become finished
hypotheses scored by ``sum / generated_length ** length_penalty``, the ``k`` best others
run on; ``early_stopping`` True, False or "never" as there), in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_NEG = np.float32(-1.0e9)  # transformers' "impossible" score


def _topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest values of ``x``, largest first, equal values in index
    order (the many ``_NEG`` ties of a search resolve to the earlier, older entries)."""
    return np.argsort(-x, kind="stable")[:k]


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """Beam search for one prompt (vLLM's and transformers' names).

    Args:
        beam_width: beams kept, and sequences returned (>= 1).
        max_tokens: new tokens per beam at most (>= 1).
        length_penalty: a finished beam scores ``cumulative logprob / generated_length **
            length_penalty``.
        early_stopping: True stops once ``beam_width`` beams finished; False when no
            running beam can beat the worst finished one at its current length; "never"
            at the best length a running beam could reach.
        ignore_eos: do not stop at the model's end-of-sequence tokens.
        stop_token_ids: further tokens that finish a beam (kept in its output).
    """

    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise TypeError(f"length_penalty: expected a float, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping: expected True, False or 'never', got {self.early_stopping!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


@dataclass(slots=True)
class BeamSearchSequence:
    """One returned beam: prompt and generated tokens (a stop token included), the sum of
    its tokens' log-probabilities, and its length-penalised score (the ranking key)."""

    tokens: list[int]
    cum_logprob: float
    score: float
    text: str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamState:
    """The beams of one request between steps: the running beams' scores, the finished
    hypotheses, and transformers' stopping state. Kept in numpy: a step works on a few
    dozen numbers, where each torch op would cost more than the arithmetic."""

    def __init__(self, prompt_len: int, params: BeamSearchParams, stop_ids: frozenset[int]) -> None:
        k = params.beam_width
        self.params = params
        self.k = k
        self.stop_ids = np.array(sorted(stop_ids), dtype=np.int64)
        self.keep = max(2, 1 + len(stop_ids)) * k
        self.prompt_len = prompt_len
        self.cur_len = prompt_len
        self.max_length = prompt_len + params.max_tokens
        self.running = np.full(k, _NEG, dtype=np.float32)
        self.running[0] = 0.0
        self.scores = np.full(k, _NEG, dtype=np.float32)  # the finished hypotheses, best first
        self.finished_tokens: list[list[int] | None] = [None] * k
        self.finished_sums: list[float] = [0.0] * k
        self.is_finished = np.zeros(k, dtype=bool)
        self.improvable = True
        self.done = False

    def step(self, log_probs, token_ids, tokens: list[list[int]]) -> list[tuple[int, int, float]]:
        """One step. Row ``i`` of ``log_probs`` (float32 ``[k, m]``, ``m >= keep``; numpy or
        a CPU tensor) holds the ``m`` largest next-token log-probabilities of running beam
        ``i`` (whose tokens are ``tokens[i]``), best first, and ``token_ids`` (int64
        ``[k, m]``) their tokens: the best ``keep`` candidates of all beams are among them,
        so the device sends no more (whole rows would be ``m = vocab``). Returns the next
        running beams as ``(parent beam, token, cumulative logprob)``, and sets
        :attr:`done` when the search is over."""
        k, keep = self.k, self.keep
        log_probs = np.asarray(log_probs, dtype=np.float32)
        token_ids = np.asarray(token_ids)
        if k == 1:  # transformers searches greedily then: the best token, to a stop or the length limit
            return self._greedy(log_probs[0, 0], int(token_ids[0, 0]), tokens[0])
        total = (log_probs + self.running[:, None]).reshape(-1)
        index = _topk(total, min(keep, total.size))
        top = total[index]
        beam, token = index // log_probs.shape[1], token_ids.reshape(-1)[index]
        last = self.cur_len + 1 >= self.max_length
        hits = np.isin(token, self.stop_ids) | last
        # The running beams of the next step: the best candidates that did not stop.
        running_scores = top + hits.astype(np.float32) * _NEG
        order = _topk(running_scores, k)
        nxt = [(int(beam[i]), int(token[i]), float(top[i])) for i in order]
        # The finished hypotheses: those among the first k candidates that stopped.
        just = hits.copy()
        just[k:] = False
        penalised = top / np.float32((self.cur_len + 1 - self.prompt_len) ** self.params.length_penalty)
        if self.is_finished.all() and self.params.early_stopping is True:
            penalised = penalised + _NEG
        if not self.improvable:
            penalised = penalised + _NEG
        penalised = penalised + (~just).astype(np.float32) * _NEG
        merged = np.concatenate([self.scores, penalised])
        best = _topk(merged, k)
        new_tokens, new_sums = [], []
        was_finished = np.concatenate([self.is_finished, just])
        for i in best:
            if i < k:
                new_tokens.append(self.finished_tokens[i])
                new_sums.append(self.finished_sums[i])
            else:
                c = i - k
                new_tokens.append(tokens[int(beam[c])] + [int(token[c])])
                new_sums.append(float(top[c]))
        self.scores = merged[best]
        self.is_finished = was_finished[best]
        self.finished_tokens, self.finished_sums = new_tokens, new_sums
        self.running = running_scores[order]
        self.cur_len += 1
        # transformers' stopping heuristics (_check_early_stop_heuristic and its caller)
        if self.params.early_stopping == "never" and self.params.length_penalty > 0.0:
            length = self.max_length - self.prompt_len
        else:
            length = self.cur_len - self.prompt_len
        best_running = float(self.running[0]) / (length ** self.params.length_penalty)
        worst = float(self.scores.min()) if self.is_finished.all() else _NEG
        self.improvable = self.improvable and best_running > worst
        open_beam = not (self.is_finished.all() and self.params.early_stopping is True)
        self.done = not (self.improvable and open_beam and not hits.all())
        return nxt

    def _greedy(self, log_prob: np.float32, token: int, tokens: list[int]) -> list[tuple[int, int, float]]:
        total = self.running[0] + log_prob  # float32, as transformers adds
        self.running[0] = total
        self.cur_len += 1
        if token in self.stop_ids or self.cur_len >= self.max_length:
            self.finished_tokens, self.finished_sums = [tokens + [token]], [float(total)]
            penalty = (self.cur_len - self.prompt_len) ** self.params.length_penalty
            self.scores = np.array([float(total) / penalty], dtype=np.float32)
            self.done = True
        return [(0, token, float(total))]

    def result(self) -> list[BeamSearchSequence]:
        """The finished hypotheses, best first (transformers returns the same ``k``)."""
        return [BeamSearchSequence(list(t), s, float(score))
                for t, s, score in zip(self.finished_tokens, self.finished_sums, self.scores.tolist())
                if t is not None]
