"""Recorded launches: a second call of a signature replays the first call's kernels.

Each test makes a first call (which checks, plans and records), then forbids the slow
path and calls again with fresh tensors of the same signature: the replay must compute
the new inputs' answer, into the new outputs, on any storage the roots come from.
"""

from __future__ import annotations

import pytest
import torch

import cascadeinfer as ci
from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention
from cascadeinfer.kernels import append as append_mod
from cascadeinfer.kernels import decode as decode_mod
from cascadeinfer.kernels import launch as launch_mod
from cascadeinfer.kernels import merge as merge_mod
from cascadeinfer.kernels import merge_many as merge_many_mod
from cascadeinfer.kernels import prefill as prefill_mod
from cascadeinfer.kernels.reference import attention_state_ref, merge_states_ref
from cascadeinfer.layouts.paged_cache import gather_paged_kv, unpack_paged_kv_cache

T = lambda x, device: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731


def forbid(monkeypatch, module, name):
    def fail(*args, **kwargs):
        raise AssertionError(f"{name} ran: the call was not replayed")

    monkeypatch.setattr(module, name, fail)


def decode_case(device, seed, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(9, 2, 4, 2, 32, generator=g).to(device, dtype)
    q = torch.randn(3, 4, 32, generator=g).to(device, dtype)
    return q, cache


def decode_reference(q, cache, indptr, indices, last):
    kv = unpack_paged_kv_cache(cache, "NHD")
    os_, ls_ = [], []
    for r in range(q.shape[0]):
        k, v = gather_paged_kv(kv, indptr, indices, last, r)
        o, lse = attention_state_ref(q[r:r + 1], k, v)
        os_.append(o)
        ls_.append(lse)
    return torch.cat(os_), torch.cat(ls_)


def assert_state(o, lse, o_ref, lse_ref, tol=5e-3):
    torch.testing.assert_close(o.double().cpu(), o_ref.cpu(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double().cpu(), lse_ref.cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("num_splits", [None, 2])
def test_decode_replays_with_new_tensors(device, monkeypatch, num_splits):
    indptr, indices, last = T([0, 3, 6, 8], device), T([0, 1, 2, 3, 4, 5, 6, 7], device), T([1, 4, 2], device)
    q, cache = decode_case(device, 0)
    ci.batch_decode_paged(q, cache, indptr, indices, last, num_splits=num_splits, out=torch.empty_like(q),
                          validate=False)
    forbid(monkeypatch, decode_mod, "decode_with_config")
    q2, cache2 = decode_case(device, 1)
    indices2 = T([8, 7, 6, 5, 4, 3, 2, 1], device)
    out = torch.full_like(q2, float("nan"))
    o, lse = ci.batch_decode_paged(q2, cache2, indptr, indices2, last, num_splits=num_splits, out=out, validate=False)
    assert o is out
    assert_state(o, lse, *decode_reference(q2, cache2, indptr, indices2, last))


def _split_call(device, seed):
    """A decode call with three KV splits, its roots and its float64 answer."""
    indptr, indices, last = T([0, 3, 6, 8], device), T([0, 1, 2, 3, 4, 5, 6, 7], device), T([1, 4, 2], device)
    q, cache = decode_case(device, seed)
    out, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:2], float("nan"), device=device)

    def call():
        return ci.batch_decode_paged(q, cache, indptr, indices, last, num_splits=3, out=out, lse=lse, validate=False)
    return call, (q, cache, out, lse), decode_reference(q, cache, indptr, indices, last)


def test_split_kv_is_one_launch_that_leaves_its_counters_zero(device):
    """With KV splits, an eager decode's last split of each row merges them in the same
    kernel: the call is one launch, and its arrival counters are zero again when it
    ends, so the next launch on them (a replay, here on the counters the recording
    keeps) needs no memset."""
    call, roots, ref = _split_call(device, 0)
    with launch_mod.recording(roots, keep_scratch=True) as rec:
        o, lse = call()
    assert len(rec.launches) == 1 and len(rec._counters) == 1
    assert rec._counters[0].numel() and not rec._counters[0].any()
    assert_state(o, lse, *ref)
    for seed in (1, 2):
        _, new_roots, new_ref = _split_call(device, seed)
        rec.replay(new_roots)
        assert not rec._counters[0].any()
        assert_state(new_roots[2], new_roots[3], *new_ref)


def test_splits_too_many_bytes_for_one_program_go_to_a_merge_kernel(device, monkeypatch):
    """Past the policy's bytes per program (and in CUDA-graph capture), the splits'
    states are merged by merge_states' kernel after the decode kernel: two launches,
    the same answer."""
    from cascadeinfer.kernels import policy

    monkeypatch.setattr(policy, "merge_in_kernel", lambda *args, **kwargs: False)
    call, roots, ref = _split_call(device, 0)
    with launch_mod.recording(roots, keep_scratch=True) as rec:
        o, lse = call()
    assert len(rec.launches) == 2 and not rec._counters
    assert_state(o, lse, *ref)


def test_decode_replay_validates_contents(device):
    indptr, indices, last = T([0, 3, 6, 8], device), T([0, 1, 2, 3, 4, 5, 6, 7], device), T([1, 4, 2], device)
    q, cache = decode_case(device, 0)
    ci.batch_decode_paged(q, cache, indptr, indices, last)
    with pytest.raises(ValueError, match="kv_indices"):
        ci.batch_decode_paged(q, cache, indptr, T([0, 1, 2, 3, 4, 5, 6, 60], device), last)


def test_tuple_cache_and_views_of_one_storage(device, monkeypatch):
    """K and V as two views of one tensor (roots sharing storage), and q cut from a wider
    projection: each argument is traced to the root it starts at."""
    indptr, indices, last = T([0, 2, 3], device), T([4, 0, 2], device), T([3, 1], device)

    def call(seed):
        g = torch.Generator().manual_seed(seed)
        kv = torch.randn(6, 2, 4, 2, 32, generator=g).to(device, torch.float16)
        proj = torch.randn(2, 6, 32, generator=g).to(device, torch.float16)
        q = proj[:, :4]  # non-contiguous rows
        o, lse = ci.batch_decode_paged(q, (kv[:, 0], kv[:, 1]), indptr, indices, last, validate=False)
        return o, lse, decode_reference(q, kv, indptr, indices, last)

    call(0)
    forbid(monkeypatch, decode_mod, "decode_with_config")
    o, lse, ref = call(1)
    assert_state(o, lse, *ref)


def test_prefill_and_ragged_replay(device, monkeypatch):
    g = torch.Generator().manual_seed(0)
    qo, kvp = T([0, 3, 5], device), T([0, 2, 3], device)
    indices, last = T([1, 3, 0], device), T([4, 2], device)

    def paged(seed, num_splits):
        g.manual_seed(seed)
        cache = torch.randn(4, 2, 4, 2, 32, generator=g).to(device, torch.float16)
        q = torch.randn(5, 4, 32, generator=g).to(device, torch.float16)
        o, lse = ci.batch_prefill_paged(q, qo, cache, kvp, indices, last, num_splits=num_splits, validate=False)
        ref = ci.batch_prefill_paged(q.cpu(), qo.cpu(), cache.cpu(), kvp.cpu(), indices.cpu(), last.cpu())
        return o, lse, ref

    def ragged(seed):
        g.manual_seed(seed)
        qkv = torch.randn(7, 8, 32, generator=g).to(device, torch.float16)  # q 4 heads, k 2, v 2
        q, k, v = qkv[:5, :4], qkv[:, 4:6], qkv[:, 6:]
        kv_indptr = T([0, 4, 7], device)
        o, lse = ci.batch_prefill_ragged(q, qo, k, v, kv_indptr, causal=True, validate=False)
        ref = ci.batch_prefill_ragged(q.cpu(), qo.cpu(), k.cpu(), v.cpu(), kv_indptr.cpu(), causal=True)
        return o, lse, ref

    for splits in (None, 2):
        paged(0, splits)
    ragged(0)
    forbid(monkeypatch, prefill_mod, "run_prefill")
    for splits in (None, 2):
        o, lse, (o_ref, lse_ref) = paged(1, splits)
        assert_state(o, lse, o_ref.double(), lse_ref.double(), 1e-2)
    o, lse, (o_ref, lse_ref) = ragged(1)
    assert_state(o, lse, o_ref.double(), lse_ref.double(), 1e-2)


def test_merges_replay(device, monkeypatch):
    def states(seed):
        g = torch.Generator().manual_seed(seed)
        v = torch.randn(3, 4, 2, 16, generator=g).to(device)
        s = torch.randn(3, 4, 2, generator=g).to(device)
        return v, s

    v, s = states(0)
    ci.merge_states(v, s, validate=False)
    ci.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1], validate=False)
    forbid(monkeypatch, merge_many_mod, "merge_states_unchecked")
    forbid(monkeypatch, merge_mod, "_merge_two")
    v, s = states(1)
    o, lse = ci.merge_states(v, s, validate=False)
    o_ref, lse_ref = merge_states_ref(v.cpu(), s.cpu())
    assert_state(o, lse, o_ref, lse_ref, 1e-5)
    o, lse = ci.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1], validate=False)
    o_ref, lse_ref = merge_states_ref(v[:, :2].cpu(), s[:, :2].cpu())
    assert_state(o, lse, o_ref, lse_ref, 1e-5)


def test_replays_allocate_fresh_outputs_like_the_recorded_ones(device, monkeypatch):
    """A replayed call that leaves its outputs to the launcher gets new contiguous tensors
    of the recorded dtype and shape (made from the recording's stride-0 templates), never
    the previous call's, in and out of inference mode."""
    indptr, indices, last = T([0, 3, 6, 8], device), T([0, 1, 2, 3, 4, 5, 6, 7], device), T([1, 4, 2], device)
    q, cache = decode_case(device, 0)
    v, s = torch.randn(3, 4, 2, 16, device=device), torch.randn(3, 4, 2, device=device)
    calls = {
        "decode": lambda: ci.batch_decode_paged(q, cache, indptr, indices, last, validate=False),
        "merge_state": lambda: ci.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1], validate=False),
        "merge_states": lambda: ci.merge_states(v, s, validate=False),
    }
    for name, call in calls.items():
        first = call()
        forbid(monkeypatch, decode_mod, "decode_with_config")
        forbid(monkeypatch, merge_many_mod, "merge_states_unchecked")
        forbid(monkeypatch, merge_mod, "_merge_two")
        for mode in (torch.inference_mode, torch.enable_grad):
            with mode():
                again = call()
            for a, b in zip(first, again):
                assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), name
                assert b.is_contiguous() and b.data_ptr() != a.data_ptr(), name
                torch.testing.assert_close(a, b, msg=name)  # same inputs, same answer
        monkeypatch.undo()


def test_merge_replay_still_checks_aliasing(device):
    """validate=True re-checks aliasing on a replayed signature: same shapes, strides and
    alignment, but the second call's out overlaps v_a by two rows."""
    g = torch.Generator().manual_seed(0)
    v, s = torch.randn(3, 4, 2, 16, generator=g).to(device), torch.randn(3, 4, 2, generator=g).to(device)
    buf, other = torch.randn(4, 2, 16, device=device), torch.empty(4, 2, 16, device=device)
    ci.merge_state(buf[0:3], s[:, 0], v[:, 1], s[:, 1], out=other[0:3], out_lse=s[:, 2].clone())
    with pytest.raises(ValueError, match="out: overlaps v_a"):
        ci.merge_state(buf[0:3], s[:, 0], v[:, 1], s[:, 1], out=buf[1:4], out_lse=s[:, 2].clone())


def test_append_replays(device, monkeypatch):
    indptr, indices, last = T([0, 2, 3], device), T([3, 0, 1], device), T([2, 4], device)
    rows, pos = T([0, 1], device), T([5, 3], device)

    def call(seed):
        g = torch.Generator().manual_seed(seed)
        cache = torch.zeros(4, 2, 4, 2, 16, device=device)
        k = torch.randn(2, 2, 16, generator=g).to(device)
        v = torch.randn(2, 2, 16, generator=g).to(device)
        ci.append_paged_kv_cache(k, v, rows, pos, cache, indices, indptr, last, validate=False)
        return cache, k, v

    call(0)
    forbid(monkeypatch, append_mod, "_launch")
    cache, k, v = call(1)
    torch.testing.assert_close(cache[0, 0, 1], k[0])  # row 0, position 5: its second page, slot 1
    torch.testing.assert_close(cache[1, 1, 3], v[1])  # row 1, position 3: page 1, slot 3


def two_level_plan(device, prefix_pages=3, batch=3):
    perm = torch.randperm(prefix_pages + 2 * batch, generator=torch.Generator().manual_seed(5)).to(torch.int32)
    qo = [T([0, batch], device), torch.arange(batch + 1, dtype=torch.int32, device=device)]
    kp = [T([0, prefix_pages], device), torch.arange(batch + 1, dtype=torch.int32, device=device) * 2]
    ki = [perm[:prefix_pages].to(device), perm[prefix_pages:].to(device)]
    kl = [T([4], device), T([1, 3, 4][:batch], device)]
    return qo, kp, ki, kl, perm


def flat_reference(q, cache, ki, kl, batch, prefix_pages):
    indptr = torch.arange(batch + 1, dtype=torch.int32) * (prefix_pages + 2)
    pages = torch.cat([torch.cat([ki[0].cpu(), ki[1].cpu()[2 * r:2 * r + 2]]) for r in range(batch)])
    return decode_reference(q.cpu(), cache.cpu(), indptr, pages.to(torch.int32), kl[1].cpu())


def test_cascade_run_replays_and_survives_replan(device, monkeypatch):
    qo, kp, ki, kl, perm = two_level_plan(device)
    attn = MultiLevelCascadeAttention(2, device=device)
    attn.plan(qo, kp, ki, kl, 4, 2, 32, 4, use_cascade=True)
    q, cache = decode_case(device, 0)
    attn.run(q, cache)
    assert len(attn._launches) == 1
    forbid(monkeypatch, MultiLevelCascadeAttention, "_record")
    q2, cache2 = decode_case(device, 1)
    o, lse = attn.run(q2, cache2, return_lse=True)
    assert_state(o, lse, *flat_reference(q2, cache2, ki, kl, 3, 3))
    # Re-planning with tables of the same shapes keeps the recordings and reads the new tables.
    ki2 = [ki[0].flip(0).contiguous(), ki[1].flip(0).contiguous()]
    attn.plan(qo, kp, ki2, kl, 4, 2, 32, 4, use_cascade=True)
    assert len(attn._launches) == 1
    o, lse = attn.run(q2, cache2, return_lse=True)
    assert_state(o, lse, *flat_reference(q2, cache2, ki2, kl, 3, 3))


def test_cascade_run_refuses_a_smaller_cache(device):
    qo, kp, ki, kl, perm = two_level_plan(device)
    attn = MultiLevelCascadeAttention(2, device=device)
    attn.plan(qo, kp, ki, kl, 4, 2, 32, 4, use_cascade=True)  # no num_pages: run checks the cache
    q, cache = decode_case(device, 0)  # 9 pages: every page id is < 9
    attn.run(q, cache)
    with pytest.raises(ValueError, match="paged_kv_cache: the plan's tables index page"):
        attn.run(q, cache[:5])


def test_call_key_sees_alignment_and_strides():
    a = torch.zeros(16, dtype=torch.float16)
    assert launch_mod.call_key(a[0:8]) != launch_mod.call_key(a[1:9])  # 2-byte offset: another alignment
    assert launch_mod.call_key(a.view(4, 4)) != launch_mod.call_key(a.view(4, 4).t())
    assert launch_mod.call_key(a[0:8], None, "NHD") == launch_mod.call_key(a[8:16], None, "NHD")


def test_cache_evicts_least_recently_used():
    cache = launch_mod.LaunchCache(maxsize=2)
    recs = [launch_mod.Recording(keep_scratch=False) for _ in range(3)]
    cache.put("a", recs[0])
    cache.put("b", recs[1])
    assert cache.get("a") is recs[0]
    cache.put("c", recs[2])
    assert cache.get("b") is None and cache.get("a") is recs[0] and cache.get("c") is recs[2]
    assert cache.get(["unhashable"]) is None


def test_find_takes_the_guarded_path_for_a_recent_signature(monkeypatch):
    cache = launch_mod.LaunchCache()
    a = torch.zeros(4, 8)
    rec = launch_mod.Recording(keep_scratch=False)
    rec_none, key, ptrs = cache.find((a,), ("x",))
    assert rec_none is None and ptrs == [a.data_ptr()]
    cache.put(key, rec)
    assert cache.find((torch.ones(4, 8),), ("x",))[0] is rec  # found by key, remembered
    monkeypatch.setattr(launch_mod, "_signature", lambda *a: (_ for _ in ()).throw(AssertionError("keyed")))
    assert cache.find((torch.full((4, 8), 2.0),), ("x",))[0] is rec  # by the guards alone
    # Anything the key sees misses the guarded path (and is keyed, which fails here).
    buf = torch.zeros(64)
    for tensors, options in [((a,), ("y",)), ((a.double(),), ("x",)), ((a.t().contiguous().t(),), ("x",)),
                             ((torch.zeros(4, 9),), ("x",)), ((buf[1:33].view(4, 8),), ("x",)), ((a, a), ("x",))]:
        with pytest.raises(AssertionError, match="keyed"):
            cache.find(tensors, options)


def test_lengthless_tensors_replay_with_any_length(device, monkeypatch):
    """A page list's length is not part of a launcher's signature (the kernels read only
    the entries its indptr names), so an engine whose page count changes every step keeps
    replaying one recording."""
    indptr, last = T([0, 3, 6, 8], device), T([1, 4, 2], device)
    q, cache = decode_case(device, 0)
    ci.batch_decode_paged(q, cache, indptr, T([0, 1, 2, 3, 4, 5, 6, 7], device), last, validate=False)
    forbid(monkeypatch, decode_mod, "decode_with_config")
    for indices in (T([8, 7, 6, 5, 4, 3, 2, 1, 0, 0, 0], device), T([2, 3, 4, 5, 6, 7, 8, 1], device)):
        for _ in range(2):  # keyed, then guarded
            o, lse = ci.batch_decode_paged(q, cache, indptr, indices, last, validate=False)
            assert_state(o, lse, *decode_reference(q, cache, indptr, indices, last))
    # The length is still checked against indptr when validating.
    with pytest.raises(ValueError, match="kv_indptr"):
        ci.batch_decode_paged(q, cache, indptr, T([0, 1, 2], device), last)


def test_direct_launch_packs_parameters_as_the_driver_reads_them():
    """The C module builds without a GPU; its parameter bytes hold every non-constexpr
    value at its natural alignment, this call's addresses patched in, and the two
    scratch pointers last (Triton 3.6's launcher layout)."""
    import struct

    from cascadeinfer.kernels import direct_launch

    types = ["*bf16", "i32", "constexpr", "fp32", "*fp32", "i64", "bf16", "i1"]
    values = [0, 7, 64, 0.5, 4096, -(2 ** 40), 1.5, True]
    data, offsets, patches, tmas, sizes = direct_launch.pack_params(types, values, {0: (1, 32), 4: (2, 0)})
    offs = struct.unpack(f"<{len(offsets) // 2}H", offsets)
    assert offs == (0, 8, 12, 16, 24, 32, 34, 40, 48)  # 7 parameters, then the two scratch pointers
    assert sizes == [8, 4, 4, 8, 8, 2, 1, 8, 8]
    assert patches == [(0, 1, 32), (16, 2, 0)] and tmas == []
    mod = direct_launch.module()
    assert mod is not None, "the direct-launch module must build wherever Triton's launchers do"
    launch = mod.prepare(0, 1, 1, 1, 128, 0, False, False, data, offsets, patches, tmas)
    raw = mod.pack(launch, (5, 1000, 2000))
    assert struct.unpack_from("<Q", raw, 0)[0] == 1032 and struct.unpack_from("<Q", raw, 16)[0] == 2000
    assert struct.unpack_from("<i", raw, 8)[0] == 7 and struct.unpack_from("<f", raw, 12)[0] == 0.5
    assert struct.unpack_from("<q", raw, 24)[0] == -(2 ** 40)
    assert raw[32:34] == bytes.fromhex("c03f") and raw[34] == 1  # bf16 1.5, i1 True
    assert raw[40:56] == bytes(16)
    with pytest.raises(ValueError, match="outside"):
        mod.prepare(0, 1, 1, 1, 128, 0, False, False, data, offsets, [(len(data) - 4, 0, 0)], [])


def test_direct_launch_packs_a_tma_descriptor_as_tritons_launcher_passes_it():
    """A TMA descriptor parameter over a root becomes a 64-byte aligned 128-byte slot for
    its CUtensorMap (encoded at each launch: innermost dimension first, strides in bytes,
    the block's box, NaN padding as the OOB fill), then its shape (i32) and strides (i64),
    as Triton 3.6's ``make_tensordesc_arg`` passes them."""
    import struct
    from types import SimpleNamespace

    from cascadeinfer.kernels import direct_launch

    desc = SimpleNamespace(shape=[4096, 128], strides=[256, 1], padding="nan")
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [16, 128], "fp4_padded": False}
    types = ["i32", "tensordesc<bf16[16, 128]>", "*fp32"]
    packed = direct_launch.pack_params(types, [5, desc, 0], {1: (0, 64), 2: (1, 0)}, [meta])
    offs = struct.unpack(f"<{len(packed.offsets) // 2}H", packed.offsets)
    assert offs == (0, 64, 192, 196, 200, 208, 216, 224, 232)  # i32, map, 2 x i32, 2 x i64, ptr, scratch x 2
    assert packed.sizes == [4, 128, 4, 4, 8, 8, 8, 8, 8]
    assert struct.unpack_from("<iiqq", packed.data, 192) == (4096, 128, 256, 1)
    assert packed.patches == [(216, 1, 0)]
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    assert packed.tmas == [(64, 0, 64, TMA_DTYPE_DEVICE_TO_HOST[10], 2, (128, 4096), (512,), (128, 16), 3, 1)]
    mod = direct_launch.module()
    launch = mod.prepare(0, 1, 1, 1, 128, 0, False, False, packed.data, packed.offsets, packed.patches,
                         packed.tmas)
    assert launch is not None
    bad = [(packed.tmas[0][0] + 8, *packed.tmas[0][1:])]
    with pytest.raises(ValueError, match="alignment"):
        mod.prepare(0, 1, 1, 1, 128, 0, False, False, packed.data, packed.offsets, packed.patches, bad)
    with pytest.raises(NotImplementedError, match="root"):
        direct_launch.pack_params(types, [5, desc, 0], {2: (1, 0)}, [meta])


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
def test_direct_launch_matches_tritons_launcher(monkeypatch, num_splits):
    """A replay through the direct launcher computes what Triton's launcher computes,
    bit for bit, for a decode with and without KV splits (their merge in the kernel)."""
    device = torch.device("cuda")
    decode_mod._LAUNCHES.clear()
    indptr, indices, last = T([0, 3, 6, 8], device), T([0, 1, 2, 3, 4, 5, 6, 7], device), T([1, 4, 2], device)
    q, cache = decode_case(device, 0, torch.bfloat16)
    ci.batch_decode_paged(q, cache, indptr, indices, last, num_splits=num_splits, validate=False)
    q2, cache2 = decode_case(device, 1, torch.bfloat16)
    o, lse = ci.batch_decode_paged(q2, cache2, indptr, indices, last, num_splits=num_splits, validate=False)
    rec = next(iter(decode_mod._LAUNCHES._items.values()))
    assert rec._direct and len(rec._direct) == len(rec.launches)
    monkeypatch.setattr(rec, "_direct", ())  # Triton's launcher
    o_ref, lse_ref = ci.batch_decode_paged(q2, cache2, indptr, indices, last, num_splits=num_splits, validate=False)
    torch.testing.assert_close(o, o_ref, atol=0, rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=0, rtol=0)
    assert_state(o, lse, *decode_reference(q2, cache2, indptr, indices, last), tol=2e-2)


@pytest.mark.gpu
def test_stream_scratch_serves_one_stream_and_never_a_capture():
    """A decode with KV splits (partial states in scratch, merged by the last split) replayed on
    the stream's scratch block, shared with another signature's recording replayed in
    between, on a second stream (its own block), and captured in a CUDA graph (the graph's
    own block) while eager replays run between the graph's replays: every answer is its
    own inputs' answer."""
    device = torch.device("cuda")
    decode_mod._LAUNCHES.clear()
    indptr, indices, last = T([0, 3, 6, 8], device), T([0, 1, 2, 3, 4, 5, 6, 7], device), T([1, 4, 2], device)

    def call(seed):
        q, cache = decode_case(device, seed, torch.bfloat16)
        o, lse = ci.batch_decode_paged(q, cache, indptr, indices, last, num_splits=3, validate=False)
        return o, lse, (q, cache)

    call(0)  # records
    o, lse, (q, cache) = call(1)  # replays on this stream's scratch block
    rec = next(iter(decode_mod._LAUNCHES._items.values()))
    main = (torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)
    assert rec.scratch_bytes and launch_mod._STREAM_SCRATCH[main].numel() >= rec.scratch_bytes
    assert rec.counter_bytes and len(rec.launches) == 1  # the splits merge in the kernel
    assert_state(o, lse, *decode_reference(q, cache, indptr, indices, last), tol=2e-2)
    # Another signature (two requests, 4 splits) on the same block, between replays of the first.
    for seed in (10, 11):
        q1, cache1 = decode_case(device, seed, torch.bfloat16)
        o1, lse1 = ci.batch_decode_paged(q1[:2], cache1, indptr[:3], indices, last[:2], num_splits=4,
                                         validate=False)
        o, lse, (q, cache) = call(seed + 10)
        assert_state(o1, lse1, *decode_reference(q1[:2], cache1, indptr[:3], indices, last[:2]), tol=2e-2)
        assert_state(o, lse, *decode_reference(q, cache, indptr, indices, last), tol=2e-2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        o2, lse2, (q2, cache2) = call(2)
    torch.cuda.current_stream().wait_stream(side)
    assert_state(o2, lse2, *decode_reference(q2, cache2, indptr, indices, last), tol=2e-2)
    assert (main[0], side.cuda_stream) in launch_mod._STREAM_SCRATCH
    q3, cache3 = decode_case(device, 3, torch.bfloat16)
    eager = set(map(id, decode_mod._LAUNCHES._items.values()))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o3, lse3 = ci.batch_decode_paged(q3, cache3, indptr, indices, last, num_splits=3, validate=False)
    # Captured, the splits go to the merge kernel (the faster form inside a graph).
    captured = [r for r in decode_mod._LAUNCHES._items.values() if id(r) not in eager]
    assert len(captured) == 1 and len(captured[0].launches) == 2 and not captured[0].counter_bytes
    for seed in (4, 5):
        graph.replay()
        o4, lse4, (q4, cache4) = call(seed)  # eager, on the kept block, right after the graph
        assert_state(o4, lse4, *decode_reference(q4, cache4, indptr, indices, last), tol=2e-2)
        assert_state(o3, lse3, *decode_reference(q3, cache3, indptr, indices, last), tol=2e-2)
    torch.cuda.synchronize()
    # Each stream's counter block (the graph's is its own) is zero between kernels.
    blocks = list(launch_mod._STREAM_COUNTERS.values())
    assert len(blocks) >= 2 and not any(b.any() for b in blocks)


@pytest.mark.gpu
def test_split_merge_holds_under_a_full_grid():
    """Thousands of programs, many rows finishing at once on every SM: each row's last
    split must see every other split's state. Twenty replays with new queries, each
    against the unsplit kernel's answer (same math, no merge), and the counters zero."""
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    batch, hkv, group, d, page, pages = 48, 8, 4, 128, 16, 40
    cache = torch.randn(batch * pages, 2, page, hkv, d, generator=g, device=device).to(torch.bfloat16)
    indptr = torch.arange(0, batch * pages + 1, pages, dtype=torch.int32, device=device)
    indices = torch.randperm(batch * pages, generator=g, device=device).to(torch.int32)
    last = torch.randint(1, page + 1, (batch,), generator=g, device=device, dtype=torch.int32)

    def run(q, splits):
        return ci.batch_decode_paged(q, cache, indptr, indices, last, num_splits=splits, validate=False)

    for _ in range(20):
        q = torch.randn(batch, hkv * group, d, generator=g, device=device).to(torch.bfloat16)
        o, lse = run(q, 16)
        o_ref, lse_ref = run(q, 1)
        torch.testing.assert_close(o.float(), o_ref.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-4)
    torch.cuda.synchronize()
    assert not any(b.any() for b in launch_mod._STREAM_COUNTERS.values())


def test_stream_blocks_are_kept_for_the_streams_used_last(monkeypatch):
    """The per-stream scratch and counter blocks are kept for the last few streams only:
    a program that makes a stream per task does not keep a block per stream it made."""
    blocks = {}
    monkeypatch.setattr(launch_mod, "_STREAM_COUNTERS", blocks)
    device = torch.device("cpu")
    for stream in range(1, launch_mod._STREAMS_KEPT + 5):  # the current stream each time: no stream switch
        block = launch_mod._stream_counters(device, 0, stream, stream, 256)
        assert blocks[(0, stream)] is block and not block.any()
    assert len(blocks) == launch_mod._STREAMS_KEPT
    assert min(s for _, s in blocks) == 5  # the oldest four dropped
    scratch = {(0, s): torch.empty(1) for s in range(launch_mod._STREAMS_KEPT)}
    again = torch.empty(1)
    launch_mod._keep(scratch, (0, 0), again)  # used again: now the most recent
    launch_mod._keep(scratch, (0, 99), torch.empty(1))
    assert (0, 0) in scratch and (0, 1) not in scratch and scratch[(0, 0)] is again
