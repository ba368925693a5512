"""CSR page tables: which pages of a paged KV cache hold each row's keys, in order.

    kv_indptr        int32 [n + 1]   row i owns kv_indices[kv_indptr[i]:kv_indptr[i + 1]]
    kv_indices       int32 [>= kv_indptr[-1]]   page numbers inside the pool
    kv_last_page_len int32 [n]       tokens used in row i's last page

**The page-table rule** (one for every launcher, the cascade plan and the engine;
:func:`check_page_table_values` is its one implementation): ``kv_indptr`` is
non-decreasing and starts at ``kv_indptr[0] >= 0``; ``kv_indices`` has at least
``kv_indptr[-1]`` entries, and the entries outside ``[kv_indptr[0], kv_indptr[-1])`` are
never read (room for fixed-capacity buffers); every used entry is a page of the pool,
``0 <= page < num_pages``. A row with ``p > 0`` pages holds ``(p - 1) * page_size +
kv_last_page_len[i]`` tokens, and ``1 <= kv_last_page_len[i] <= page_size``. A row with
no pages holds 0 tokens.

**Empty rows (our convention, strict):** a row with no pages must have
``kv_last_page_len == 0``. FlashInfer ignores the value there; we reject anything else
when validating, so that a stale length next to a missing page list is caught instead of
silently read as "empty". :func:`get_seq_lens` returns 0 for empty rows whatever the value.

The device-side helpers (:func:`get_seq_lens`, :func:`get_batch_indices_positions`) are
pure torch ops with no host sync, so they can run inside a captured CUDA graph (the
latter's optional check of ``seq_lens`` reads them on the host, and is skipped while
capturing). The validators read tensors on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cascadeinfer._checks import check_int32_vector, check_tensor
from cascadeinfer._device import capturing
from cascadeinfer.layouts.indptr import as_int_list, check_monotone, host_array

_INT32_MAX = 2**31 - 1


def _check_positive_int(name: str, x: object, *, minimum: int = 1) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    if x < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {x}")
    return x


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """Tokens per row of a CSR page table: int32 ``[n]``, on the tables' device.

    ``kv_indptr`` int32 ``[n + 1]``, ``kv_last_page_len`` int32 ``[n]``. A row with
    ``p > 0`` pages holds ``(p - 1) * page_size + kv_last_page_len``; a row with no pages
    holds 0 (its last_page_len is ignored here). Pure device ops, no host sync.
    """
    check_tensor("kv_indptr", kv_indptr, ndim=1, dtypes=(torch.int32,))
    if kv_indptr.shape[0] == 0:
        raise ValueError("kv_indptr: expected at least one entry (n + 1 for n rows)")
    n = kv_indptr.shape[0] - 1
    check_tensor("kv_last_page_len", kv_last_page_len, dtypes=(torch.int32,), device=kv_indptr.device, shape=(n,))
    _check_positive_int("page_size", page_size)
    num_pages = kv_indptr[1:] - kv_indptr[:-1]
    full = (num_pages - 1) * page_size + kv_last_page_len
    return torch.where(num_pages > 0, full, torch.zeros_like(full))


def get_batch_indices_positions(
    append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int, *, validate: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and position of every appended token, for :func:`append_paged_kv_cache`.

    ``append_indptr`` int32 ``[n + 1]`` splits the ``nnz`` appended tokens into rows;
    ``seq_lens`` int32 ``[n]`` are the rows' lengths *including* the appended tokens. Token
    ``j = append_indptr[i] + t`` gets ``batch_indices[j] = i`` and
    ``positions[j] = seq_lens[i] - append_len_i + t``. Returns ``(batch_indices,
    positions)``, both int32 ``[nnz]`` on the inputs' device.

    ``nnz`` is a host int. Tokens ``j >= append_indptr[-1]`` (when ``nnz`` is a padded
    upper bound) get ``batch_indices = -1`` and ``positions = -1``, which
    ``append_paged_kv_cache`` skips.

    A row's ``seq_lens[i]`` must be at least the number of tokens it appends. With
    ``validate`` (reads both tensors on the host; skipped while a CUDA graph is being
    captured) a shorter one raises ``ValueError`` naming ``seq_lens``. Without it (no
    host sync, CUDA-graph safe) the tokens whose position would be negative get
    ``batch_indices = -1`` and ``positions = -1`` too, so they are skipped, never
    written at a negative position.
    """
    check_tensor("append_indptr", append_indptr, ndim=1, dtypes=(torch.int32,))
    if append_indptr.shape[0] == 0:
        raise ValueError("append_indptr: expected at least one entry (n + 1 for n rows)")
    n = append_indptr.shape[0] - 1
    dev = append_indptr.device
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), device=dev, shape=(n,))
    _check_positive_int("nnz", nnz, minimum=0)
    if not isinstance(validate, bool):
        raise TypeError(f"validate: expected a bool, got {type(validate).__name__}")
    if validate and n and not capturing():
        appended = (append_indptr[1:] - append_indptr[:-1]).cpu()
        short = seq_lens.cpu() < appended
        if bool(short.any()):
            row = int(short.nonzero()[0, 0])
            raise ValueError(
                f"seq_lens: row {row} has length {int(seq_lens[row])} but appends {int(appended[row])} tokens; "
                "seq_lens must count the appended tokens too"
            )
    if n == 0:
        pad = torch.full((nnz,), -1, dtype=torch.int32, device=dev)
        return pad, pad.clone()
    token = torch.arange(nnz, dtype=torch.int32, device=dev)
    # The last row whose start is <= token: rows that append nothing share their start
    # with the next row and are skipped by right=True.
    row = torch.searchsorted(append_indptr, token, right=True, out_int32=True) - 1
    valid = token < append_indptr[-1]
    safe_row = row.clamp(0, n - 1)
    # seq_lens[i] - (append_indptr[i+1] - append_indptr[i]) + (token - append_indptr[i])
    pos = seq_lens[safe_row] - append_indptr[safe_row + 1] + token
    valid &= pos >= 0  # a seq_len shorter than the append (not validated): skip, never a negative slot
    minus_one = torch.full_like(token, -1)
    return torch.where(valid, row, minus_one), torch.where(valid, pos, minus_one)


def validate_page_table(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
    num_pages: int | None,
    *,
    contents: bool = True,
) -> None:
    """Check a CSR page table against the library's one page-table rule (the module
    docstring); raise ``ValueError``/``TypeError`` naming the argument.

    Always (no host sync): the three tensors are int32, 1-D, contiguous and on one device,
    ``len(kv_last_page_len) == len(kv_indptr) - 1``, ``page_size >= 1`` and ``num_pages``
    (the pool size, or ``None`` to skip the range check) ``>= 0``.

    With ``contents`` (reads the tensors on the host: launchers pass
    ``contents=validate and not capturing()``): :func:`check_page_table_values`.
    """
    check_tensor("kv_indptr", kv_indptr, ndim=1)
    dev = kv_indptr.device
    check_int32_vector("kv_indptr", kv_indptr, dev)
    if kv_indptr.shape[0] == 0:
        raise ValueError("kv_indptr: expected at least one entry (n + 1 for n rows)")
    n = kv_indptr.shape[0] - 1
    check_int32_vector("kv_indices", kv_indices, dev)
    check_int32_vector("kv_last_page_len", kv_last_page_len, dev, length=n)
    _check_positive_int("page_size", page_size)
    if num_pages is not None:
        _check_positive_int("num_pages", num_pages, minimum=0)
    if contents:
        indptr = kv_indptr.cpu()
        used = kv_indices[int(indptr[0]):int(indptr[-1])] if _indptr_ok(indptr, kv_indices.shape[0]) else kv_indices
        check_page_table_values(indptr, used.cpu(), kv_last_page_len.cpu(), page_size, num_pages,
                                num_indices=kv_indices.shape[0], used_only=True)


def check_pages_in_pool(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, num_pages: int) -> None:
    """The PyTorch path's bound check, made whatever ``validate`` says (host tensors: it
    costs nothing there): an unchecked table gives an ``IndexError`` naming the argument,
    never a read or a write of another page. Negative ids would wrap around in PyTorch
    indexing, so they are caught here rather than by the indexing itself."""
    if kv_indptr.numel() == 0:
        return
    first, total = int(kv_indptr[0]), int(kv_indptr[-1])
    if first < 0 or total > kv_indices.numel() or bool((kv_indptr[1:] < kv_indptr[:-1]).any()):
        raise IndexError(f"kv_indptr: rows reach outside kv_indices ({kv_indices.numel()} entries)")
    used = kv_indices[first:total]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
        raise IndexError(f"kv_indices: page ids must lie in [0, {num_pages}), got {int(used.min())}..{int(used.max())}")


def _indptr_ok(indptr: torch.Tensor, num_indices: int) -> bool:
    return bool(indptr.numel()) and 0 <= int(indptr[0]) <= int(indptr[-1]) <= num_indices


def check_page_table_values(
    kv_indptr: torch.Tensor | np.ndarray,
    kv_indices: torch.Tensor | np.ndarray,
    kv_last_page_len: torch.Tensor | np.ndarray,
    page_size: int,
    num_pages: int | None,
    *,
    num_indices: int | None = None,
    used_only: bool = False,
    names: tuple[str, str, str] = ("kv_indptr", "kv_indices", "kv_last_page_len"),
) -> None:
    """The page-table rule on host integer tensors or numpy arrays; raise ``ValueError``
    naming ``names``.

    ``kv_indptr`` is non-decreasing from ``kv_indptr[0] >= 0``; ``kv_indices`` has at least
    ``kv_indptr[-1]`` entries (``num_indices``, when ``kv_indices`` is only the used slice
    ``[kv_indptr[0], kv_indptr[-1])``, as ``used_only`` says); every used index lies in
    ``[0, num_pages)`` (or is only non-negative when ``num_pages`` is None); a row with
    pages has ``kv_last_page_len`` in ``[1, page_size]``, a row without pages has 0.
    """
    ip_name, ix_name, last_name = names
    indptr, indices, last = host_array(kv_indptr), host_array(kv_indices), host_array(kv_last_page_len)
    if indptr.size == 0:
        raise ValueError(f"{ip_name}: expected at least one entry (n + 1 for n rows)")
    first, total = int(indptr[0]), int(indptr[-1])
    if first < 0:
        raise ValueError(f"{ip_name}: expected a first entry >= 0, got {first}")
    rows_pages = np.subtract(indptr[1:], indptr[:-1], dtype=np.int64)  # int64: no overflow
    if rows_pages.size and rows_pages.min() < 0:
        check_monotone(ip_name, indptr)  # raises, naming the first drop
    have = indices.shape[0] if num_indices is None else num_indices
    if total > have:
        raise ValueError(f"{ix_name}: has {have} entries but {ip_name}[-1] is {total}")
    _check_page_ids(ix_name, indices if used_only else indices[first:total], first, num_pages)
    _check_last_page_lens(last_name, rows_pages, last, page_size)


def _check_page_ids(name: str, used: np.ndarray, first: int, num_pages: int | None) -> None:
    """Every used page id (``used``, entries ``first..`` of ``kv_indices``) lies in
    ``[0, num_pages)``, or is non-negative when ``num_pages`` is None."""
    if used.size == 0:
        return
    if num_pages is None:
        if used.min() >= 0:
            return
    else:
        # One pass: as unsigned, a negative id is at least 2**(bits - 1), past any id the
        # dtype can hold, so one max bounds both ends.
        bits = 8 * used.itemsize
        if used.view(f"u{used.itemsize}").max() < min(num_pages, 2 ** (bits - 1)):
            return
    bad = used < 0 if num_pages is None else (used < 0) | (used >= num_pages)
    pos = int(bad.argmax())
    where = "negative" if num_pages is None else f"outside the pool of {num_pages} pages"
    raise ValueError(f"{name}: index {int(used[pos])} at position {first + pos} is {where}")


def _check_last_page_lens(name: str, rows_pages: np.ndarray, last: np.ndarray, page_size: int) -> None:
    """``last`` in ``[1, page_size]`` on rows with pages and 0 on rows without; the first
    row of the first kind that fails is reported before any row of the second kind."""
    has_pages = rows_pages > 0
    # One pass for the common case: the bounds are [1, page_size] or [0, 0] per row.
    if not np.count_nonzero((last < has_pages) | (last > has_pages * page_size)):
        return
    bad_full = has_pages & ((last < 1) | (last > page_size))
    if bad_full.any():
        row = int(bad_full.argmax())
        raise ValueError(
            f"{name}: row {row} has {int(rows_pages[row])} pages and last_page_len "
            f"{int(last[row])}; expected 1..{page_size}"
        )
    row = int(((~has_pages) & (last != 0)).argmax())
    raise ValueError(
        f"{name}: row {row} has no pages and last_page_len {int(last[row])}; "
        "an empty row must have last_page_len 0"
    )


@dataclass(frozen=True, slots=True, eq=False)
class PageTable:
    """A validated CSR page table (see the module docstring for the format).

    Fields: ``kv_indptr [n + 1]``, ``kv_indices [kv_indptr[-1]]``, ``kv_last_page_len [n]``
    (int32, contiguous, one device), ``page_size`` and optionally ``num_pages`` (the pool
    size; when given every index must lie inside it). Construction validates everything
    (a host sync) and raises ``ValueError``/``TypeError`` naming the field. The tensors are
    the caller's, not copies: do not mutate them afterwards. ``eq=False``: tables compare
    by identity (elementwise tensor equality has no single truth value).
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int
    num_pages: int | None = None

    def __post_init__(self) -> None:
        validate_page_table(
            self.kv_indptr, self.kv_indices, self.kv_last_page_len, self.page_size, self.num_pages
        )

    @classmethod
    def from_page_lists(
        cls,
        page_lists: Sequence[Sequence[int]],
        seq_lens: Sequence[int] | torch.Tensor,
        page_size: int,
        *,
        num_pages: int | None = None,
        device: torch.device | str | None = None,
    ) -> PageTable:
        """Build a table from per-row page lists and token counts (host data).

        Row ``i`` must list exactly ``cdiv(seq_lens[i], page_size)`` pages (none for an
        empty row). The tensors are created on ``device`` (CPU by default).
        """
        _check_positive_int("page_size", page_size)
        if page_size > _INT32_MAX:  # the table's lengths are int32
            raise ValueError(f"page_size: expected at most {_INT32_MAX}, got {page_size}")
        if isinstance(seq_lens, torch.Tensor):
            check_tensor("seq_lens", seq_lens, ndim=1)
            seq_lens = seq_lens.cpu().tolist()
        lens = as_int_list("seq_lens", seq_lens)
        if isinstance(page_lists, (str, bytes, torch.Tensor)):
            raise TypeError(f"page_lists: expected a sequence of page lists, got {type(page_lists).__name__}")
        rows = [as_int_list(f"page_lists[{i}]", pages) for i, pages in enumerate(page_lists)]
        if len(rows) != len(lens):
            raise ValueError(f"seq_lens: has {len(lens)} entries but page_lists has {len(rows)} rows")
        indptr, indices, last = [0], [], []
        for i, (pages, length) in enumerate(zip(rows, lens)):
            if length < 0:
                raise ValueError(f"seq_lens: entry {i} is {length}, expected >= 0")
            need = -(-length // page_size)
            if len(pages) != need:
                raise ValueError(
                    f"page_lists: row {i} has {len(pages)} pages but seq_len {length} needs "
                    f"cdiv({length}, {page_size}) = {need}"
                )
            if pages and (min(pages) < 0 or max(pages) > _INT32_MAX):
                bad = min(pages) if min(pages) < 0 else max(pages)
                raise ValueError(f"page_lists: row {i} holds page id {bad}; page ids are int32 in [0, {_INT32_MAX}]")
            indices.extend(pages)
            indptr.append(len(indices))
            last.append(length - (need - 1) * page_size if need > 0 else 0)

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return cls(as_tensor(indptr), as_tensor(indices), as_tensor(last), page_size, num_pages)

    @classmethod
    def trusted(cls, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                page_size: int, num_pages: int | None = None) -> PageTable:
        """A table whose tensors have just passed :func:`check_page_table_values` (e.g. with
        a caller's own argument names), or a device copy of a validated table: built
        without a second host pass over the same values."""
        table = object.__new__(cls)
        for name, value in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                            ("kv_last_page_len", kv_last_page_len), ("page_size", page_size),
                            ("num_pages", num_pages)):
            object.__setattr__(table, name, value)
        return table

    def to(self, device: torch.device | str) -> PageTable:
        """The same table on ``device`` (its values are the validated ones)."""
        return PageTable.trusted(*(t.to(device) for t in (self.kv_indptr, self.kv_indices, self.kv_last_page_len)),
                                 self.page_size, self.num_pages)

    @property
    def num_rows(self) -> int:
        return self.kv_indptr.shape[0] - 1

    @property
    def device(self) -> torch.device:
        return self.kv_indptr.device

    def seq_lens(self) -> torch.Tensor:
        """Tokens per row, int32 ``[num_rows]`` on the table's device (no host sync)."""
        return get_seq_lens(self.kv_indptr, self.kv_last_page_len, self.page_size)
