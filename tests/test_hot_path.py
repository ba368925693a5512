"""The C++ hot path of replayed calls (cascadeinfer/kernels/hot_path.cpp).

Without a GPU: the module builds against the installed torch, and its lookup takes a call
only with the exact signature an entry was made from (dtype, device, dispatch keys,
requires_grad, sizes except a page list's length, strides, options, 16-byte aligned
addresses). On the GPU: every launcher that asks it first computes its inputs' answer
through it, and where it must decline (another stream than its scratch's, a capture, a
profiler's hooks) the Python path gives the same answer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cascadeinfer as ci
from cascadeinfer.kernels import decode as decode_mod
from cascadeinfer.kernels import hot_path
from cascadeinfer.kernels import launch as launch_mod
from cascadeinfer.kernels import merge as merge_mod
from cascadeinfer.kernels import merge_many as merge_many_mod
from cascadeinfer.kernels import prefill as prefill_mod
from cascadeinfer.kernels.reference import attention_state_ref, merge_states_ref

T = lambda x, device: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731


def _call(dtype=torch.bfloat16, length=8):
    """A decode-like call's tensors: q, a page list of any length (index 1), out."""
    q = torch.randn(3, 4, 32).to(dtype)
    return q, torch.zeros(length, dtype=torch.int32), torch.empty(3, 4, 32, dtype=dtype)


def _add(mod, cache, options, tensors, sources, templates, returned=(), lengthless=(), single=False):
    """An entry that launches nothing (no steps), unbound to any stream."""
    mod.add(cache, options, tensors, lengthless, sources, templates, returned, single, (), -1, False, 0, 0, 0, None,
            None, None)


def test_lookup_takes_only_the_signature_it_was_made_from():
    mod = hot_path.module()
    assert mod is not None, "the hot path must build wherever torch's headers and a C++ compiler are"
    cache = mod.new_cache()
    options = (1, "NHD", None)
    q, pages, out = _call()
    # roots: q, the page list, out given, lse allocated like the template
    _add(mod, cache, options, (q, pages, out), (0, 1, 2, -1), (None, None, None, torch.empty(3, 4)), (2, 3),
         lengthless=(1,))
    assert mod.size(cache) == 1
    assert mod.match(cache, _call(), options) == 0
    assert mod.match(cache, _call(length=5), options) == 0  # a page list of any length
    assert mod.match(cache, _call(), (1, "HND", None)) == -1
    assert mod.match(cache, _call(torch.float16), options) == -1
    q2, pages2, out2 = _call()
    assert mod.match(cache, (q2[:2], pages2, out2), options) == -1  # another size
    assert mod.match(cache, (q2.transpose(0, 1).contiguous().transpose(0, 1), pages2, out2), options) == -1  # strides
    flat = torch.empty(3 * 4 * 32 + 1, dtype=torch.bfloat16)
    assert mod.match(cache, (flat[1:].view(3, 4, 32), pages2, out2), options) == -1  # 2 bytes off alignment
    assert mod.match(cache, (q2.requires_grad_(), pages2, out2), options) == -1
    with torch.inference_mode():
        inference = _call()
    assert mod.match(cache, inference, options) == -1  # other dispatch keys
    with FakeTensorMode() as fake:
        traced = tuple(fake.from_tensor(t) for t in _call())
    assert mod.match(cache, traced, options) == -1  # torch.compile's fake tensors never match
    assert mod.match(cache, (q, pages, "out"), options) == -1
    assert mod.match(cache, (q, pages), options) == -1
    # A call seen with a misaligned tensor gets no entry (its kernels were not specialised on alignment).
    _add(mod, cache, ("misaligned",), (flat[1:].view(3, 4, 32), pages, out), (0, 1, 2), (None, None, None))
    assert mod.size(cache) == 1


def test_a_recording_in_progress_takes_the_python_path():
    """Inside a recording (the cascade records its levels' and merge's launches) the hot
    path must decline, or the recording would miss the kernels it enqueued: it checks the
    recording's context variable before anything else it reads for the call."""
    from triton import knobs

    mod = hot_path.module()
    assert mod is not None
    streams_asked = []

    def current_stream(device):  # the first thing the hot path reads once it takes a call
        streams_asked.append(device)
        raise RuntimeError("past the checks")

    cache, call = mod.new_cache(), None
    options = ("a launcher",)
    q, pages, out = _call()
    _add(mod, cache, options, (q, pages, out), (0, 1, 2), (None, None, None))
    call = mod.caller(cache)
    mod.configure(launch_mod._STREAM_SCRATCH, current_stream, knobs.runtime, launch_mod._RECORDING)
    try:
        with launch_mod.recording((q, out)):
            assert call((q, pages, out), options) is None
            with launch_mod.unrecorded():  # launches kept by no recording may take it
                with pytest.raises(RuntimeError, match="past the checks"):
                    call((q, pages, out), options)
        assert len(streams_asked) == 1
        with pytest.raises(RuntimeError, match="past the checks"):
            call((q, pages, out), options)
        assert len(streams_asked) == 2
    finally:  # as kernels.launch configures it
        mod.configure(launch_mod._STREAM_SCRATCH, getattr(torch._C, "_cuda_getCurrentRawStream", current_stream),
                      knobs.runtime, launch_mod._RECORDING)


def test_entries_are_replaced_per_signature_and_bounded():
    mod = hot_path.module()
    cache = mod.new_cache()
    call = _call()

    def add(options, sources=(0, 1, 2), returned=(), single=False):
        _add(mod, cache, options, call, sources, (None, None, call[2]), returned, single=single)

    add(("a",))
    add(("a",))  # the same signature again: replaces its entry
    assert mod.size(cache) == 1
    for name in "bcde":
        add((name,))
    assert mod.size(cache) == 4  # the oldest dropped
    assert mod.match(cache, call, ("a",)) == -1 and mod.match(cache, call, ("e",)) == 0
    with pytest.raises(ValueError, match="template"):
        _add(mod, cache, ("f",), call, (0, 1, -1), (None, None, None))
    with pytest.raises(ValueError, match="returned"):
        add(("f",), returned=(3,))
    with pytest.raises(ValueError, match="returned"):
        add(("f",), sources=(0, 1, -2), returned=(2,))  # a fixed buffer is never handed out
    with pytest.raises(ValueError, match="single"):
        add(("f",), returned=(1, 2), single=True)
    with pytest.raises(ValueError, match="kind"):
        mod.add(cache, ("f",), call, (), (0, 1, 2), (None, None, None), (), False, ((7, None, ()),), -1, False, 0,
                0, 0, None, None, None)
    mod.clear(cache)
    assert mod.size(cache) == 0


def test_the_first_build_runs_in_the_background(monkeypatch, tmp_path, caplog):
    """A launcher never waits for the compiler: the first ask starts the build on a thread
    and gets None (the Python path) until the module is there; a failed build is reported
    once and the Python path stays."""
    import shutil
    import threading

    built = hot_path._target()[1]
    assert hot_path.module() is not None and built.exists()
    release = threading.Event()

    def slow_build(src, target):
        release.wait(60)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(built, target)

    def failed_build(src, target):
        raise RuntimeError("no compiler here")

    monkeypatch.setenv("CASCADEINFER_CACHE_DIR", str(tmp_path / "first"))
    monkeypatch.setattr(hot_path, "_build", slow_build)
    for attr, value in (("thread", None), ("error", None), ("gave_up", False)):
        monkeypatch.setattr(hot_path._Background, attr, value)
    hot_path.module.cache_clear()
    try:
        assert hot_path.module_if_ready() is None  # the build starts
        assert hot_path.module_if_ready() is None  # still building
        release.set()
        hot_path._Background.thread.join(60)
        mod = hot_path.module_if_ready()
        assert mod is not None and Path(mod.__file__).is_relative_to(tmp_path)

        hot_path.module.cache_clear()
        monkeypatch.setenv("CASCADEINFER_CACHE_DIR", str(tmp_path / "second"))
        monkeypatch.setattr(hot_path, "_build", failed_build)
        monkeypatch.setattr(hot_path._Background, "thread", None)
        assert hot_path.module_if_ready() is None
        hot_path._Background.thread.join(60)
        with caplog.at_level("WARNING"):
            assert hot_path.module_if_ready() is None and hot_path.module_if_ready() is None
        assert sum("no compiler here" in r.getMessage() for r in caplog.records) == 1
    finally:
        hot_path.module.cache_clear()  # the next caller loads the build in the default place again


def test_roots_of_a_replay():
    """Inputs first, then out and lse, each given (the next tensor) or allocated (-1)."""
    assert launch_mod.hot_roots(None, 3) == ((0, 1, 2), ())
    assert launch_mod.hot_roots((2, True, True), 2) == ((0, 1, -1, -1), (2, 3))
    assert launch_mod.hot_roots((2, False, True), 3) == ((0, 1, 2, -1), (2, 3))
    assert launch_mod.hot_roots((2, True, False), 3) == ((0, 1, -1, 2), (2, 3))
    assert launch_mod.hot_roots((2, False, False), 4) == ((0, 1, 2, 3), (2, 3))
    assert launch_mod.hot_roots((2, False, False), 3) is None


def test_cascade_program_roots():
    """A cascade run's roots for the hot path: q and the cache, then out and lse, each
    given or allocated, except an LSE nobody asked for, which is the plan's own buffer
    (never returned); one launch step without a side stream."""
    from types import SimpleNamespace

    from cascadeinfer.cascade.multi_level import _Launches

    templates = tuple(torch.empty(i + 1) for i in range(4))
    upper = SimpleNamespace(_hot_state=(False,), _direct=("launch",), _templates=templates, valid=True)
    plan_lse = torch.empty(2)
    launches = _Launches(plan_lse, upper)
    p = launches.hot_program(2, True, True, True)
    assert p.sources == (0, 1, -1, -1) and p.returned == (2, 3) and not p.single
    assert p.templates[2] is templates[2] and p.templates[3] is templates[3]
    assert p.steps == ((launch_mod.LAUNCH, None, ("launch",)),) and p.keep is launches
    p = launches.hot_program(2, True, True, False)
    assert p.sources == (0, 1, -1, -2) and p.returned == (2,) and p.single and p.templates[3] is plan_lse
    p = launches.hot_program(2, False, False, False)
    assert p.sources == (0, 1, 2, 3) and p.returned == (2,) and p.templates == (None,) * 4
    p = launches.hot_program(2, True, False, True)
    assert p.sources == (0, 1, -1, 2) and p.returned == (2, 3)
    upper._hot_state = None  # its last replay went through Triton's launcher
    assert launches.hot_program(2, True, True, True) is None


# ---- on the GPU


def _forbid_python_path(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the call took the Python path")

    monkeypatch.setattr(launch_mod.LaunchCache, "find", fail)


def _decode_inputs(device, g, batch=3, splits_pages=(3, 3, 2)):
    pages = sum(splits_pages)
    cache = torch.randn(pages + 1, 2, 4, 2, 64, generator=g, device=device).to(torch.bfloat16)
    q = torch.randn(batch, 8, 64, generator=g, device=device).to(torch.bfloat16)
    indptr = torch.tensor([0, *torch.tensor(splits_pages).cumsum(0).tolist()], dtype=torch.int32, device=device)
    indices = torch.randperm(pages, generator=g, device=device).to(torch.int32)
    last = torch.randint(1, 5, (batch,), generator=g, device=device, dtype=torch.int32)
    return q, cache, indptr, indices, last


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("given", [False, True])
def test_decode_through_the_hot_path(monkeypatch, num_splits, given):
    """Allocated or given outputs, without KV splits and with them (scratch and counters
    bound to the stream): the fourth call goes through the hot path and matches the
    Python path bit for bit."""
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(num_splits)
    decode_mod._LAUNCHES.clear()

    def call(inputs, out=None, lse=None):
        q, cache, indptr, indices, last = inputs
        return ci.batch_decode_paged(q, cache, indptr, indices, last, num_splits=num_splits, out=out, lse=lse,
                                     validate=False)

    def outputs(q):
        if not given:
            return {}
        return {"out": torch.full_like(q, float("nan")),
                "lse": torch.full(q.shape[:2], float("nan"), device=device)}

    inputs = _decode_inputs(device, g)
    for _ in range(3):  # records, replays (prepares the direct launches), replays and binds
        call(inputs, **outputs(inputs[0]))
    assert decode_mod._LAUNCHES._hot is not None and launch_mod._hot_module().size(decode_mod._LAUNCHES._hot) == 1
    fresh = _decode_inputs(device, g)
    expected = call(fresh, **outputs(fresh[0]))  # already the hot path: compare with the Python path below
    with monkeypatch.context() as m:
        m.setenv("CASCADEINFER_HOT_PATH", "0")
        m.setattr(decode_mod._LAUNCHES, "hot", lambda *a: None)
        reference = call(fresh, **outputs(fresh[0]))
    torch.testing.assert_close(expected[0], reference[0], atol=0, rtol=0)
    torch.testing.assert_close(expected[1], reference[1], atol=0, rtol=0)
    _forbid_python_path(monkeypatch)
    for _ in range(3):
        fresh = _decode_inputs(device, g)
        kwargs = outputs(fresh[0])
        o, lse = call(fresh, **kwargs)
        if given:
            assert o is kwargs["out"] and lse is kwargs["lse"]
        o_ref, lse_ref = _decode_reference(*fresh)
        torch.testing.assert_close(o.double(), o_ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.double(), lse_ref, atol=1e-3, rtol=1e-3)
    torch.cuda.synchronize()
    assert not any(b.any() for b in launch_mod._STREAM_COUNTERS.values())


def _decode_reference(q, cache, indptr, indices, last):
    from cascadeinfer.layouts.paged_cache import gather_paged_kv, unpack_paged_kv_cache

    kv = unpack_paged_kv_cache(cache, "NHD")
    states = [attention_state_ref(q[r:r + 1], *gather_paged_kv(kv, indptr, indices, last, r))
              for r in range(q.shape[0])]
    return torch.cat([s[0] for s in states]), torch.cat([s[1] for s in states])


@pytest.mark.gpu
def test_every_launcher_asks_the_hot_path_first(monkeypatch):
    """The prefix level (KV splits: scratch, then a merge kernel), a ragged prefill,
    shared-prefix attention, the merges and the append: each one's fourth call runs
    through the hot path alone, on new inputs, and gives their answer."""
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    bf = torch.bfloat16

    def rand(*shape, dtype=bf):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    pages = 40
    cache = rand(pages, 2, 16, 2, 64)
    indptr, last = T([0, pages], device), T([16], device)
    indices = torch.arange(pages, dtype=torch.int32, device=device)
    qo_indptr = T([0, 8], device)

    def prefix():
        q = rand(8, 8, 64)
        o, lse = ci.batch_prefill_paged(q, qo_indptr, cache, indptr, indices, last, num_splits=4, validate=False)
        k, v = cache[:, 0].reshape(-1, 2, 64), cache[:, 1].reshape(-1, 2, 64)  # every page, in order, full
        return (o, lse), attention_state_ref(q, k, v)

    def ragged():
        q, k, v = rand(6, 8, 64), rand(20, 2, 64), rand(20, 2, 64)
        o, lse = ci.batch_prefill_ragged(q, T([0, 2, 6], device), k, v, T([0, 9, 20], device), validate=False)
        o_ref = torch.empty(6, 8, 64, dtype=torch.float64, device=device)
        lse_ref = torch.empty(6, 8, dtype=torch.float64, device=device)
        for (a, b), (c, d) in (((0, 2), (0, 9)), ((2, 6), (9, 20))):
            o_ref[a:b], lse_ref[a:b] = attention_state_ref(q[a:b], k[c:d], v[c:d])
        return (o, lse), (o_ref, lse_ref)

    def shared():
        q, k, v = rand(5, 8, 64), rand(33, 2, 64), rand(33, 2, 64)
        return ci.shared_prefix_attention(q, k, v), attention_state_ref(q, k, v)

    def merge_two():
        va, vb = rand(7, 4, 64), rand(7, 4, 64)
        sa, sb = rand(7, 4, dtype=torch.float32), rand(7, 4, dtype=torch.float32)
        return (ci.merge_state(va, sa, vb, sb, validate=False),
                merge_states_ref(torch.stack([va, vb], 1), torch.stack([sa, sb], 1)))

    def merge_many():
        v, s = rand(7, 3, 4, 64), rand(7, 3, 4, dtype=torch.float32)
        return ci.merge_states(v, s, validate=False), merge_states_ref(v, s)

    cases = [(prefix, prefill_mod._PAGED), (ragged, prefill_mod._RAGGED), (shared, prefill_mod._SHARED),
             (merge_two, merge_mod._MERGE_STATE), (merge_many, merge_many_mod._MERGE_STATES)]
    for make, launches in cases:
        launches.clear()
        for _ in range(3):
            make()
        assert launch_mod._hot_module().size(launches._hot) == 1, make.__name__
    with monkeypatch.context() as m:
        _forbid_python_path(m)
        for make, _ in cases:
            for _ in range(2):
                (o, lse), (o_ref, lse_ref) = make()
                torch.testing.assert_close(o.double(), o_ref.double(), atol=2e-2, rtol=2e-2, msg=make.__name__)
                torch.testing.assert_close(lse.double(), lse_ref.double(), atol=1e-3, rtol=1e-3,
                                           msg=make.__name__)


@pytest.mark.gpu
def test_append_through_the_hot_path(monkeypatch):
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    cache = torch.zeros(6, 2, 4, 2, 64, dtype=torch.bfloat16, device=device)
    indptr, indices, last = T([0, 3, 6], device), T([5, 0, 3, 1, 4, 2], device), T([2, 4], device)
    batch, positions = T([0, 0, 1], device), T([8, 9, 11], device)
    for step in range(5):
        if step == 3:
            _forbid_python_path(monkeypatch)
        k = torch.randn(3, 2, 64, generator=g, device=device).to(torch.bfloat16)
        v = torch.randn(3, 2, 64, generator=g, device=device).to(torch.bfloat16)
        ci.append_paged_kv_cache(k, v, batch, positions, cache, indices, indptr, last, validate=False)
        for j, (b, p) in enumerate(((0, 8), (0, 9), (1, 11))):
            page = indices[indptr[b] + p // 4]
            torch.testing.assert_close(cache[page, 0, p % 4], k[j], atol=0, rtol=0)
            torch.testing.assert_close(cache[page, 1, p % 4], v[j], atol=0, rtol=0)


@pytest.mark.gpu
def test_the_hot_path_declines_where_the_python_path_must_run():
    """Calls whose scratch (and counters) the hot path bound to one stream: on another
    stream, inside a CUDA-graph capture and with a profiler's launch hook set, they go
    the Python way, and every answer is its own inputs'."""
    from triton import knobs

    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(5)
    decode_mod._LAUNCHES.clear()
    prefill_mod._PAGED.clear()

    def decode(inputs):
        q, cache, indptr, indices, last = inputs
        return ci.batch_decode_paged(q, cache, indptr, indices, last, num_splits=3, validate=False)

    def check(inputs, state):
        o_ref, lse_ref = _decode_reference(*inputs)
        torch.testing.assert_close(state[0].double(), o_ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(state[1].double(), lse_ref, atol=1e-3, rtol=1e-3)

    inputs = _decode_inputs(device, g)
    for _ in range(4):
        decode(inputs)
    assert launch_mod._hot_module().size(decode_mod._LAUNCHES._hot) == 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fresh = _decode_inputs(device, g)
        state = decode(fresh)
    torch.cuda.current_stream().wait_stream(side)
    check(fresh, state)
    calls = []
    knobs.runtime.launch_enter_hook.add(calls.append)
    try:
        fresh = _decode_inputs(device, g)
        check(fresh, decode(fresh))
    finally:
        knobs.runtime.launch_enter_hook.remove(calls.append)
    assert calls, "with a launch hook set the call must go through Triton's launcher"

    # The prefix level with KV splits: its options do not tell a capture apart, so the
    # hot path itself must see the capture and decline (the graph takes its own scratch).
    cache = torch.randn(40, 2, 16, 2, 64, generator=g, device=device).to(torch.bfloat16)
    table = (T([0, 40], device), torch.arange(40, dtype=torch.int32, device=device), T([16], device))
    k, v = cache[:, 0].reshape(-1, 2, 64), cache[:, 1].reshape(-1, 2, 64)

    qo_indptr = T([0, 8], device)  # made before the capture: no host copy may run inside it

    def prefix(q):
        return ci.batch_prefill_paged(q, qo_indptr, cache, *table, num_splits=4, validate=False)

    for _ in range(3):
        prefix(torch.randn(8, 8, 64, generator=g, device=device).to(torch.bfloat16))
    assert launch_mod._hot_module().size(prefill_mod._PAGED._hot) == 1
    captured_q = torch.randn(8, 8, 64, generator=g, device=device).to(torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = prefix(captured_q)
    for _ in range(2):
        graph.replay()
        q = torch.randn(8, 8, 64, generator=g, device=device).to(torch.bfloat16)
        o, lse = prefix(q)  # eager, on the stream's block, between the graph's replays
        o_ref, lse_ref = attention_state_ref(q, k, v)
        torch.testing.assert_close(o.double(), o_ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.double(), lse_ref, atol=1e-3, rtol=1e-3)
        o_ref, lse_ref = attention_state_ref(captured_q, k, v)
        torch.testing.assert_close(captured[0].double(), o_ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(captured[1].double(), lse_ref, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,use_cascade", [(16, True), (4, True), (16, False)])
def test_cascade_run_through_the_hot_path(monkeypatch, batch, use_cascade):
    """``MultiLevelCascadeAttention.run``: two levels on two streams (16 requests: the
    prefix level's 64-row tiles on a share of the SMs; 4: its 16-row tiles on its whole
    grid), and the flat path; outputs allocated or given, the LSE returned or
    not. From the second call of each form on, the hot path runs it alone, and its
    answer is the Python path's bit for bit, and the float64 reference's."""
    from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention

    from test_cascade import shared_prefix_reference

    dev = torch.device("cuda")
    prefix_pages, suffix_pages, page_size, hq, hkv, d = 512, 16, 16, 32, 8, 128
    num_pages = prefix_pages + batch * suffix_pages
    g = torch.Generator().manual_seed(batch)
    perm = torch.randperm(num_pages, generator=g).int()
    last = torch.randint(1, page_size + 1, (batch,), generator=g)
    tables = [[torch.tensor([0, batch]), torch.arange(batch + 1)],
              [torch.tensor([0, prefix_pages]), torch.arange(batch + 1) * suffix_pages],
              [perm[:prefix_pages], perm[prefix_pages:]], [torch.tensor([page_size]), last]]
    tables = [[t.int().to(dev) for t in x] for x in tables]
    cache = torch.randn(num_pages, 2, page_size, hkv, d, dtype=torch.bfloat16, device=dev)
    attn = MultiLevelCascadeAttention(2, device=dev)
    attn.plan(*tables, hq, hkv, d, page_size, use_cascade=use_cascade)
    assert attn._overlap == use_cascade

    def call(q, given, return_lse):
        out = torch.full_like(q, float("nan")) if given else None
        lse = torch.full((batch, hq), float("nan"), device=dev) if given else None
        result = attn.run(q, cache, out=out, lse=lse, return_lse=return_lse)
        o, s = result if return_lse else (result, lse)
        if given:
            assert o is out and (s is lse)
        return o, s

    def fresh_q():
        return torch.randn(batch, hq, d, dtype=torch.bfloat16, device=dev)

    for given in (False, True):
        for return_lse in (False, True):
            call(fresh_q(), given, return_lse)  # records, replays, binds
            q = fresh_q()
            with monkeypatch.context() as m:
                _forbid_python_path(m)
                o, s = call(q, given, return_lse)
            with monkeypatch.context() as m:
                m.setattr(attn._launches, "hot", lambda *a: None)
                o_py, s_py = call(q, given, return_lse)
            torch.testing.assert_close(o, o_py, atol=0, rtol=0)
            if s is not None:
                torch.testing.assert_close(s, s_py, atol=0, rtol=0)
    o_ref, lse_ref = shared_prefix_reference(q, cache, perm, prefix_pages, suffix_pages, last, page_size)
    torch.testing.assert_close(o.double().cpu(), o_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(s.double().cpu(), lse_ref, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
def test_a_cascade_records_its_merge_where_the_merge_is_hot():
    """A cascade's first run records its levels and merge. With ``merge_state`` already
    hot for the very shapes of the cascade's merge, the merge inside the recording must
    still go through the Python path: else the recording misses it, and the replays
    return an LSE nobody wrote (the output only by chance: the recording's own buffer
    freed and handed out again)."""
    from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention

    from test_cascade import shared_prefix_reference

    dev = torch.device("cuda")
    batch, prefix_pages, suffix_pages, page_size, hq, hkv, d = 2, 4, 2, 16, 4, 2, 64
    num_pages = prefix_pages + batch * suffix_pages
    g = torch.Generator().manual_seed(11)
    perm = torch.randperm(num_pages, generator=g).int()
    last = torch.randint(1, page_size + 1, (batch,), generator=g)
    tables = [[torch.tensor([0, batch]), torch.arange(batch + 1)],
              [torch.tensor([0, prefix_pages]), torch.arange(batch + 1) * suffix_pages],
              [perm[:prefix_pages], perm[prefix_pages:]], [torch.tensor([page_size]), last]]
    cache = torch.randn(num_pages, 2, page_size, hkv, d, dtype=torch.float16, device=dev)
    state = lambda: (torch.randn(batch, hq, d, dtype=torch.float16, device=dev),  # noqa: E731
                     torch.randn(batch, hq, device=dev))
    for _ in range(4):  # merge_state hot for [batch, hq, d] fp16 with both outputs given
        (va, sa), (vb, sb), (o, s) = state(), state(), state()
        ci.merge_state(va, sa, vb, sb, out=o, out_lse=s, validate=False)
    assert launch_mod._hot_module().size(merge_mod._MERGE_STATE._hot) >= 1
    attn = MultiLevelCascadeAttention(2, device=dev)
    attn.plan(*[[t.int().to(dev) for t in x] for x in tables], hq, hkv, d, page_size)
    for _ in range(3):  # the record and its replay, then the hot path's replays
        q = torch.randn(batch, hq, d, dtype=torch.float16, device=dev)
        o, lse = attn.run(q, cache, return_lse=True)
        o_ref, lse_ref = shared_prefix_reference(q, cache, perm, prefix_pages, suffix_pages, last, page_size)
        torch.testing.assert_close(o.double().cpu(), o_ref, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse.double().cpu(), lse_ref, atol=1e-3, rtol=1e-3)
