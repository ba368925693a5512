"""Grouping decode rows into cascade levels from their page lists, for any engine.

An engine knows each running request's pages in order (shared prompt pages first, its
own last). :func:`group_levels` orders the requests so that those sharing pages are
adjacent and cuts the shared runs into levels, ready for
:meth:`~cascadeinfer.cascade.multi_level.MultiLevelCascadeAttention.plan`.
"""

from __future__ import annotations

from cascadeinfer.cascade.plan import HostLevel


def group_levels(
    page_lists: list[list[int]], last_page_lens: list[int], num_levels: int, page_size: int
) -> tuple[list[int], list[HostLevel]]:
    """Order decode rows so that rows sharing pages are adjacent, and cut them into levels.

    ``page_lists[r]`` are row ``r``'s pages in order (its last page is its own: it is being
    written); ``last_page_lens[r]`` the tokens in that page. Returns ``(order, levels)``:
    ``order[i]`` is the row that becomes query ``i``; ``levels`` has ``num_levels`` tables.
    Level ``l < num_levels - 1`` has a group per set of adjacent rows that share a run of
    pages beyond the levels above (their longest common prefix), plus one group without
    pages collecting the rows that share nothing more; the last level has one group per
    row with its remaining pages. Only full pages ever sit above the last level.
    """
    # A row's last page is its own (being written): only pages[:-1] can be shared. Rows are
    # sorted by their whole lists, compared in place (slicing off the last pages to sort
    # by the shareable parts alone would copy every list: 3x the sort's time at 256 rows
    # of 272 pages). Lexicographic order keeps every set of rows with a common prefix
    # adjacent, all the cut below needs, and a row strictly between two rows that share
    # a prefix of length l is at least l + 1 pages long, so the first and last rows of a
    # run bound its common shareable prefix. The cut reads the lists in place, up to the
    # shareable lengths.
    shareable = [len(pages) - 1 for pages in page_lists]  # how many of a row's pages can be shared
    upper: list[list[tuple[int, list[int]]]] = [[] for _ in range(num_levels - 1)]
    order: list[int] = []
    offset_of: dict[int, int] = {}

    def split(rows: list[int], offset: int, level: int) -> None:
        if level == num_levels - 1:
            order.extend(rows)
            offset_of.update((r, offset) for r in rows)
            return
        runs: list[list[int]] = []  # adjacent rows with the same page at `offset`
        for r in rows:
            if runs and shareable[r] > offset and shareable[runs[-1][0]] > offset \
                    and page_lists[r][offset] == page_lists[runs[-1][0]][offset]:
                runs[-1].append(r)
            else:
                runs.append([r])
        rest = []
        for run in runs:
            if len(run) == 1:
                rest.extend(run)
                continue
            # Sorted: the run's common prefix is that of its first and last rows.
            first, last = page_lists[run[0]], page_lists[run[-1]]
            end = min(shareable[run[0]], shareable[run[-1]])
            lcp = offset
            while lcp < end and first[lcp] == last[lcp]:
                lcp += 1
            upper[level].append((len(run), first[offset:lcp]))
            split(run, lcp, level + 1)
        if rest:
            upper[level].append((len(rest), []))
            split(rest, offset, level + 1)

    split(sorted(range(len(page_lists)), key=page_lists.__getitem__), 0, 0)

    levels = []
    for groups in upper:
        qo, kv, idx, last = [0], [0], [], []
        for size, pages in groups:
            qo.append(qo[-1] + size)
            idx.extend(pages)
            kv.append(len(idx))
            last.append(page_size if pages else 0)
        levels.append(HostLevel.from_lists(qo, kv, idx, last, page_size))
    kv, idx = [0], []
    for r in order:
        idx.extend(page_lists[r][offset_of[r]:])
        kv.append(len(idx))
    levels.append(HostLevel.from_lists(list(range(len(order) + 1)), kv, idx, [last_page_lens[r] for r in order],
                                       page_size))
    return order, levels
