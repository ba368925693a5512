"""The text of a growing sample, decoded a few tokens at a time.

A streamed request's output carries its whole text at every step. Decoding the whole
list each time costs time in the list's length (SmolLM2's tokenizer on a 2-core Xeon:
25 µs for 128 tokens, 48 for 256), so a generation pays the square of its length and 256
streamed requests pay milliseconds per step. :class:`IncrementalText` decodes only a
window, the tokens read at the last update and those added since (2-3 µs an update), and
appends what the window's text gained. Decoding the window's first token in both texts
keeps what a tokenizer does at the start of a text (a leading space stripped) out of the
difference; text ending in an unfinished UTF-8 character (U+FFFD) waits for the next
token. A sample's final text is
decoded whole (``LLM._output``), so only the texts of its updates come from here.
"""

from __future__ import annotations


class IncrementalText:
    """``update(tokenizer, ids)``: the text of ``ids`` (which only grow between calls),
    decoded with ``skip_special_tokens=True``, for the cost of a few tokens."""

    __slots__ = ("text", "_start", "_read")

    def __init__(self) -> None:
        self.text = ""
        self._start = 0  # the window's first token: the one before the text last added
        self._read = 0  # tokens whose text is in ``text``

    def update(self, tokenizer, ids: list[int]) -> str:
        if len(ids) < self._read:
            raise ValueError(f"ids: {len(ids)} tokens, fewer than the {self._read} already decoded")
        if len(ids) == self._read:
            return self.text
        before = tokenizer.decode(ids[self._start:self._read], skip_special_tokens=True)
        after = tokenizer.decode(ids[self._start:], skip_special_tokens=True)
        if len(after) > len(before) and after.startswith(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._start, self._read = self._read, len(ids)
        return self.text
