"""The custom ops: registered schemas pass opcheck, and cascade ``run`` compiles with fullgraph."""

from __future__ import annotations

import pytest
import torch

import cascadeinfer.ops  # noqa: F401  (registers torch.ops.cascadeinfer.*)
from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention
from cascadeinfer.kernels.decode import batch_decode_paged

I32 = dict(dtype=torch.int32)


def small_batch(device, dtype=torch.float16, batch=2, hq=4, hkv=2, d=16, page=4):
    torch.manual_seed(0)
    cache = torch.randn(8, 2, page, hkv, d, dtype=dtype, device=device)
    q = torch.randn(batch, hq, d, dtype=dtype, device=device)
    kv_indptr = torch.tensor([0, 2, 3], **I32, device=device)
    kv_indices = torch.tensor([5, 1, 6], **I32, device=device)
    kv_last = torch.tensor([3, 4], **I32, device=device)
    return q, cache, kv_indptr, kv_indices, kv_last


def test_opcheck_decode_and_merge(device):
    q, cache, kv_indptr, kv_indices, kv_last = small_batch(device)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=device)
    torch.library.opcheck(torch.ops.cascadeinfer.batch_decode_paged.default,
                          (q, cache, None, kv_indptr, kv_indices, kv_last, "NHD", 0.25, 1, out, lse),
                          test_utils=("test_schema", "test_faketensor"))
    s = torch.randn(q.shape[:2], device=device)
    torch.library.opcheck(torch.ops.cascadeinfer.merge_state.default,
                          (q, s, q.flip(0), s.flip(0), torch.empty_like(q), torch.empty_like(s)),
                          test_utils=("test_schema", "test_faketensor"))


def test_op_matches_function(device):
    q, cache, kv_indptr, kv_indices, kv_last = small_batch(device)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=device)
    k, v = cache[:, 0], cache[:, 1]
    torch.ops.cascadeinfer.batch_decode_paged(q, k, v, kv_indptr, kv_indices, kv_last, "NHD", 0.25, None, out, lse)
    o_ref, lse_ref = batch_decode_paged(q, cache, kv_indptr, kv_indices, kv_last, sm_scale=0.25)
    torch.testing.assert_close(out, o_ref)
    torch.testing.assert_close(lse, lse_ref)


@pytest.mark.parametrize("use_cascade", [True, False])
def test_cascade_run_compiles_fullgraph(device, use_cascade):
    """Both plans compile: the cascade, and flat decode over the shared page (its decode op
    carries the "shared_pages" schedule)."""
    q, cache, kv_indptr, kv_indices, kv_last = small_batch(device)
    attn = MultiLevelCascadeAttention(2, device=device)
    attn.plan([torch.tensor([0, 2], **I32), torch.tensor([0, 1, 2], **I32)],
              [torch.tensor([0, 1], **I32), torch.tensor([0, 1, 2], **I32)],
              [torch.tensor([7], **I32), torch.tensor([1, 6], **I32)],
              [torch.tensor([4], **I32), torch.tensor([3, 4], **I32)],
              4, 2, 16, 4, use_cascade=use_cascade)
    if not use_cascade:
        assert attn._flat.schedule == "shared_pages"

    def layer(x, kv):
        return attn.run(x * 2, kv, return_lse=True, sm_scale=0.3)

    backend = "inductor" if device.type == "cuda" else "aot_eager"  # no C++ build on CPU CI
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    o, lse = compiled(q, cache)
    o_ref, lse_ref = layer(q, cache)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref)


@pytest.mark.gpu
def test_cascade_run_in_cuda_graph_through_ops():
    dev = torch.device("cuda", 0)
    q, cache, kv_indptr, kv_indices, kv_last = small_batch(dev, dtype=torch.bfloat16, hq=32, hkv=8, d=128, page=16)
    attn = MultiLevelCascadeAttention(1, device=dev)
    attn.plan([torch.tensor([0, 1, 2], **I32)], [kv_indptr], [kv_indices], [kv_last], 32, 8, 128, 16)
    out = torch.empty_like(q)
    attn.run(q, cache, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, cache, out=out)
    expected = out.clone()
    out.zero_()
    graph.replay()
    torch.testing.assert_close(out, expected)


def test_ops_validate_when_asked(device):
    """validate=True (the ops' last argument) checks the page table before any launch;
    the default skips the host read, as on the hot path."""
    q, cache, kv_indptr, kv_indices, kv_last = small_batch(device)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=device)
    outside = torch.tensor([5, 1, 60], **I32, device=device)  # the pool has 8 pages
    with pytest.raises(ValueError, match="kv_indices: index 60 at position 2 is outside the pool of 8 pages"):
        torch.ops.cascadeinfer.batch_decode_paged(q, cache, None, kv_indptr, outside, kv_last, "NHD", 0.25, None,
                                                  out, lse, None, True)
    qo = torch.tensor([0, 1, 2], **I32, device=device)
    with pytest.raises(ValueError, match="kv_indices"):
        torch.ops.cascadeinfer.batch_prefill_paged(q, qo, cache, None, kv_indptr, outside, kv_last, False, "NHD",
                                                   0.25, None, out, lse, True)
    k_new = torch.randn(2, 2, 16, dtype=q.dtype, device=device)
    rows, pos = torch.tensor([0, 1], **I32, device=device), torch.tensor([6, 3], **I32, device=device)
    before = cache.clone()
    with pytest.raises(ValueError, match="kv_indices"):
        torch.ops.cascadeinfer.append_paged_kv_cache(k_new, k_new.clone(), rows, pos, cache, None, outside,
                                                     kv_indptr, kv_last, "NHD", True)
    assert torch.equal(cache, before)  # refused before anything was written


def test_torch_path_unchecked_tables_raise_never_write(monkeypatch):
    """On the plain-PyTorch path validate=False still bounds-checks (it is free there): an
    out-of-pool or negative page id is an IndexError, never a read or write of another page."""
    from cascadeinfer.kernels import append as append_mod
    from cascadeinfer.kernels import decode as decode_mod

    from cascadeinfer.kernels.launch import LaunchCache

    for mod in (append_mod, decode_mod):
        monkeypatch.setattr(mod, "use_triton", lambda dev: False)
        # A recording of the same signature from an earlier test of this process would
        # replay the kernels (under the interpreter) instead of taking the PyTorch path.
        monkeypatch.setattr(mod, "_LAUNCHES", LaunchCache())
    q, cache, kv_indptr, kv_indices, kv_last = small_batch("cpu", dtype=torch.float32)
    k_new = torch.randn(2, 2, 16)
    rows, pos = torch.tensor([0, 1], **I32), torch.tensor([6, 3], **I32)
    for bad in ([5, 1, 60], [5, -1, 6]):
        table = torch.tensor(bad, **I32)
        with pytest.raises(IndexError, match="kv_indices"):
            decode_mod.batch_decode_paged(q, cache, kv_indptr, table, kv_last, validate=False)
        before = cache.clone()
        with pytest.raises(IndexError, match="kv_indices"):
            append_mod.append_paged_kv_cache(k_new, k_new.clone(), rows, pos, cache, table, kv_indptr, kv_last,
                                             validate=False)
        assert torch.equal(cache, before)
    with pytest.raises(IndexError, match="positions"):  # a position past the row's pages
        append_mod.append_paged_kv_cache(k_new, k_new.clone(), rows, torch.tensor([9, 3], **I32), cache,
                                         kv_indices, kv_indptr, kv_last, validate=False)
