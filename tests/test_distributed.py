"""The distributed paths over torch.distributed: 2 CPU processes joined by gloo, and the
gpu-marked tests with NCCL (one GPU per process; a test of N ranks needs N GPUs and is
skipped on fewer).

Each test body runs in every rank (``run_ranks``); an assertion failing in a rank fails
the test. The ranks inherit the test run's kernel path (the Triton interpreter on a CPU)
and apply the same interpreter patches as this process (conftest).
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cascadeinfer.distributed import merge_states_across
from cascadeinfer.kernels.reference import attention_state_ref

WORLD = 2


def _rank_main(rank: int, world: int, init_file: str, backend: str, body, args) -> None:
    import conftest  # noqa: F401, PLC0415 - the interpreter patches, as in the parent

    kw = {}
    if backend == "nccl":  # GPU ``rank`` for rank ``rank``
        kw["device_id"] = torch.device("cuda", rank)
        torch.cuda.set_device(kw["device_id"])
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world, **kw)
    try:
        body(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(body, *args, world: int = WORLD, backend: str = "gloo") -> None:
    """Run ``body(rank, world, *args)`` in ``world`` fresh processes joined by ``backend``
    (gloo on CPUs; NCCL with GPU ``rank`` current in rank ``rank``)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(world, os.path.join(tmp, "init"), backend, body, args), nprocs=world, join=True)


def _device(backend: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def _gpus(world: int):
    """``world`` as a test parameter, skipped where fewer than ``world`` GPUs exist."""
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= world
    return pytest.param(world, id=f"{world}gpus", marks=pytest.mark.skipif(not enough, reason=f"needs {world} GPUs"))


NCCL_WORLDS = [_gpus(2), _gpus(4)]


def _split_keys(seed: int, rank: int, world: int, n: int, hq: int, hkv: int, d: int, dtype: torch.dtype):
    """Every rank draws the same rows and keys, then takes its own share of each row's keys:
    a random owner per key, with rows wholly on one rank (the others' parts are empty) and a
    row with no key at all. Returns q, this rank's state, and the state over all keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=g)
    o_part = torch.empty(n, hq, d, dtype=dtype)
    lse_part = torch.empty(n, hq)
    o_all = torch.empty(n, hq, d, dtype=torch.float64)
    lse_all = torch.empty(n, hq, dtype=torch.float64)
    for row in range(n):
        length = 0 if row == 0 else int(torch.randint(1, 40, (1,), generator=g))
        k = torch.randn(length, hkv, d, generator=g)
        v = torch.randn(length, hkv, d, generator=g)
        owner = torch.randint(0, world, (length,), generator=g)
        if row % 3 == 1:
            owner.fill_(row % world)  # the whole row on one rank
        mine = owner == rank
        o, lse = attention_state_ref(q[row:row + 1], k[mine], v[mine])
        o_part[row], lse_part[row] = o[0].to(dtype), lse[0].float()
        o, lse = attention_state_ref(q[row:row + 1], k, v)
        o_all[row], lse_all[row] = o[0], lse[0]
    return o_part, lse_part, o_all, lse_all


def _body_equals_attention_over_all_keys(rank, world, seed, dtype, backend="gloo"):
    o_part, lse_part, o_ref, lse_ref = _split_keys(seed, rank, world, 7, 4, 2, 32, dtype)
    dev = _device(backend, rank)
    o_part, lse_part, o_ref, lse_ref = (x.to(dev) for x in (o_part, lse_part, o_ref, lse_ref))
    out = torch.full_like(o_part, float("nan"))
    out_lse = torch.full_like(lse_part, float("nan"))
    o, lse = merge_states_across(o_part, lse_part, out=out, out_lse=out_lse)
    assert o is out and lse is out_lse
    tol = 2e-3 if dtype == torch.float32 else 5e-3
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o.double(), o_ref, atol=tol, rtol=tol)
    assert torch.isneginf(lse[0]).all() and (o[0] == 0).all()  # no rank saw a key of row 0
    torch.testing.assert_close(lse[1:].double(), lse_ref[1:], atol=1e-4, rtol=1e-4)
    # every rank holds the same bits
    gathered = [torch.empty_like(o) for _ in range(world)]
    dist.all_gather(gathered, o)
    assert all(torch.equal(x, o) for x in gathered)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_states_across_equals_attention_over_all_keys(dtype):
    run_ranks(_body_equals_attention_over_all_keys, 11, dtype)


def _body_lse_gaps(rank, world, backend="gloo"):
    """States 80 apart in LSE (either way) merge without overflow or NaN, to float64's merge."""
    g = torch.Generator().manual_seed(5)
    n, h, d = 6, 3, 16
    o_all = torch.randn(world, n, h, d, generator=g)
    lse_all = torch.randn(world, n, h, generator=g)
    lse_all[1] += 80.0 * torch.sign(torch.randn(n, h, generator=g))
    lse_all[0, 2] = -math.inf  # rank 0 saw none of row 2's keys
    o_all[0, 2] = 0.0
    dev = _device(backend, rank)
    o, lse = merge_states_across(o_all[rank].clone().to(dev), lse_all[rank].clone().to(dev))
    o, lse = o.cpu(), lse.cpu()
    m = lse_all.double().max(dim=0).values
    w = torch.exp(lse_all.double() - m)
    lse_ref = m + torch.log(w.sum(0))
    o_ref = (w[..., None] * o_all.double()).sum(0) / w.sum(0)[..., None]
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-6)


def test_merge_states_across_lse_gaps():
    run_ranks(_body_lse_gaps)


def test_merge_states_across_one_rank_and_bad_input():
    o, lse = torch.randn(3, 2, 8), torch.randn(3, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        merge_states_across(o, lse)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1)
        try:
            merged, merged_lse = merge_states_across(o, lse)
            torch.testing.assert_close(merged, o)
            torch.testing.assert_close(merged_lse, lse)
            with pytest.raises(ValueError, match="lse"):
                merge_states_across(o, lse[:2])
            with pytest.raises(TypeError, match="lse"):
                merge_states_across(o, lse.double())
            with pytest.raises(ValueError, match="o"):
                merge_states_across(o[0], lse)
        finally:
            dist.destroy_process_group()


# ---- the context-parallel cascade


def _body_context_parallel(rank, world, cases, backend="gloo"):
    import random  # noqa: PLC0415

    from test_cascade import check_close, random_tree, reference, tables  # noqa: PLC0415

    from cascadeinfer import MultiLevelCascadeAttention  # noqa: PLC0415
    from cascadeinfer.layouts.paged_cache import unpack_paged_kv_cache  # noqa: PLC0415

    hq, hkv, d, batch = 4, 2, 32, 4
    dev = _device(backend, rank)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5  # the parts' roundings differ from the whole's
    for seed, num_levels, cp_level, qpr, causal, page in cases:
        rng = random.Random(seed)
        torch.manual_seed(seed)  # every rank draws the same tables, cache and queries
        levels, used = random_tree(rng, num_levels, batch, 5 * page + 1, page, qpr, causal)
        num_pages = used + 3
        perm = torch.randperm(num_pages).tolist()
        cache = torch.randn(num_pages, 2, page, hkv, d).to(dev, dtype)
        q = torch.randn(batch * qpr, hq, d).to(dev, dtype)
        tabs = tables(levels, page, perm, dev)
        attn = MultiLevelCascadeAttention(num_levels, device=dev, context_parallel_level=cp_level)
        attn.plan(*tabs, hq, hkv, d, page, causal=causal, num_pages=num_pages)
        out = torch.full_like(q, float("nan"))
        o, lse = attn.run(q, cache, out=out, return_lse=True)
        assert o is out
        whole = MultiLevelCascadeAttention(num_levels, device=dev)
        whole.plan(*tabs, hq, hkv, d, page, causal=causal, num_pages=num_pages, use_cascade=True)
        o_whole, lse_whole = whole.run(q, cache, return_lse=True)
        torch.testing.assert_close(o.float(), o_whole.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(lse, lse_whole, atol=tol, rtol=tol)
        o_ref, lse_ref = reference(q.cpu(), unpack_paged_kv_cache(cache.cpu(), "NHD"), levels, perm, batch, qpr,
                                   causal, d ** -0.5)
        check_close(o.cpu(), lse.cpu(), o_ref, lse_ref, dtype)
        if dev.type == "cuda":  # replayed from a CUDA graph, the all-gather captured with it
            replayed = _replayed(lambda: attn.run(q, cache, out=out), out)
            torch.testing.assert_close(replayed.float(), o_whole.float(), atol=tol, rtol=tol)


def _replayed(run, out: torch.Tensor) -> torch.Tensor:
    """``run()`` captured in a CUDA graph, ``out`` poisoned, the graph replayed: ``out``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return out


_CP_CASES = [
    (3, 2, 0, 1, False, 4),  # shared prefix split, decode level whole
    (8, 3, 1, 1, False, 4),  # a middle level split
    (5, 1, 0, 1, False, 16),  # one level: each request's own pages split
    (9, 2, 0, 2, True, 4),  # causal last level; the prefix level split
]


def test_context_parallel_cascade_equals_the_whole_cascade():
    """A level's pages cut across 2 ranks (groups shorter than the ranks get empty shares),
    its states merged across them: the single-process cascade's answer on every rank."""
    run_ranks(_body_context_parallel, _CP_CASES)


def test_context_parallel_plan_rejects():
    from cascadeinfer import MultiLevelCascadeAttention  # noqa: PLC0415

    with pytest.raises(ValueError, match="context_parallel_level"):
        MultiLevelCascadeAttention(2, context_parallel_level=2)
    with pytest.raises(ValueError, match="context_parallel_level"):
        MultiLevelCascadeAttention(2, context_parallel_level=0, use_cuda_graph=True, max_pages=4)
    i32 = dict(dtype=torch.int32)
    t = lambda *x: torch.tensor(x, **i32)  # noqa: E731
    two = ([t(0, 2), t(0, 1, 2)], [t(0, 1), t(0, 1, 2)], [t(0), t(1, 2)], [t(4), t(2, 3)])
    attn = MultiLevelCascadeAttention(2, device="cpu", context_parallel_level=0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        attn.plan(*two, 4, 2, 32, 4)
    causal = MultiLevelCascadeAttention(2, device="cpu", context_parallel_level=1)
    with pytest.raises(ValueError, match="causal last level"):
        causal.plan(*two, 4, 2, 32, 4, causal=True)
    with pytest.raises(ValueError, match="use_cascade"):
        attn.plan(*two, 4, 2, 32, 4, use_cascade=False)


# ---- a tensor-parallel model


def _causal_attention(layer, q, k, v):
    """Every token over the step's own tokens up to it (one forward of a whole prompt)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                         is_causal=True)
    return o.transpose(0, 1).contiguous()


def _forward(path, tokens, tp):
    from cascadeinfer.engine.llama import LlamaForCausalLM  # noqa: PLC0415
    from cascadeinfer.engine.model_loader import ModelConfig  # noqa: PLC0415

    model = LlamaForCausalLM(ModelConfig.from_dir(path), dtype=torch.float32, device="cpu", fused=False, tp=tp)
    model.load_checkpoint(path)
    ids = torch.tensor(tokens)
    return model(ids, torch.arange(len(tokens)), _causal_attention)


def _body_tensor_parallel_logits(rank, world, path, tokens, expected):
    from cascadeinfer.engine.llama import TensorParallel  # noqa: PLC0415

    logits = _forward(path, tokens, TensorParallel(rank, world))
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tensor_parallel_model_gives_the_whole_model_logits(arch, tmp_path):
    """Heads and MLP split over 2 gloo ranks (column-parallel QKV and gate/up, row-parallel
    o and down with an all-reduce): each rank's logits equal the unsplit model's and
    transformers' on the same checkpoint (a tiny random Llama and Qwen2, with biases)."""
    from test_engine import _tiny  # noqa: PLC0415

    hf = _tiny(arch, tmp_path, **({"attention_bias": True, "mlp_bias": True} if arch == "llama" else {}))
    tokens = [5, 17, 3, 99, 42, 7, 64, 11]
    whole = _forward(tmp_path, tokens, __import__("cascadeinfer.engine.llama", fromlist=["_WHOLE"])._WHOLE)
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(whole, theirs, atol=1e-4, rtol=1e-4)
    run_ranks(_body_tensor_parallel_logits, str(tmp_path), tokens, whole)


def test_tensor_parallel_sizes_must_divide_the_model():
    from cascadeinfer.engine.llama import TensorParallel  # noqa: PLC0415
    from cascadeinfer.engine.model_loader import preset  # noqa: PLC0415

    config = preset("tiny")
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide the model's num_qo_heads"):
        TensorParallel(0, 3).check(config)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        TensorParallel(0, 0)
    with pytest.raises(ValueError, match="rank"):
        TensorParallel(2, 2)


# ---- the tensor-parallel engine


@pytest.mark.parametrize("arch, graph_path", [("llama", False), ("qwen2", False), ("llama", True)])
def test_tensor_parallel_engine_gives_the_same_tokens(arch, graph_path, tmp_path, monkeypatch):
    """LLM(..., tensor_parallel_size=2): a worker process holds the other half of the heads
    and MLP; greedy tokens equal TP=1's and transformers', with shared prompts, n > 1
    samples (their copy-on-write page copies repeated in the worker) and requests that
    finish at different times. On the decode graph path (run eagerly here) rank 0 is a
    step ahead and the worker takes the tokens from the broadcast samples."""
    from test_engine import GREEDY, SHARED, UNSHARED, _tiny, hf_greedy  # noqa: PLC0415

    from cascadeinfer.engine import LLM, SamplingParams  # noqa: PLC0415

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # every rank on the PyTorch path (plain CPU tensors)
    model = _tiny(arch, tmp_path)
    prompts = SHARED + UNSHARED
    params = [SamplingParams(max_tokens=3 + i, n=2 if i == 1 else 1, **GREEDY) for i in range(len(prompts))]
    kw = dict(device="cpu", dtype=torch.float32, page_size=4, num_pages=96, decode_graph_path=graph_path,
              record_steps=True)
    one = [[s.token_ids for s in o.outputs] for o in LLM(tmp_path, **kw).generate(prompts, params)]
    llm = LLM(tmp_path, tensor_parallel_size=2, **kw)
    try:
        two = [[s.token_ids for s in o.outputs] for o in llm.generate(prompts, params)]
        assert llm.cache.copies > 0  # the n = 2 request copied its shared last page
        assert any(s.graph for s in llm.step_stats) == graph_path
    finally:
        llm.close()
    assert two == one
    for prompt, p, outs in zip(prompts, params, two):
        assert all(t == hf_greedy(model, prompt, p.max_tokens, "cpu") for t in outs)


def test_step_rows_send_page_lists_once_then_their_ends():
    """RowSender/RowReceiver: the worker's page lists equal rank 0's through growth,
    copy-on-write of the last page, a replaced list, a step without the sequence and a
    list cut short; a running sequence's row carries its last page sent and the new ones."""
    import pickle  # noqa: PLC0415
    from types import SimpleNamespace  # noqa: PLC0415

    from cascadeinfer.engine.parallel import RowReceiver, RowSender  # noqa: PLC0415
    from cascadeinfer.engine.scheduler import ScheduledBatch  # noqa: PLC0415

    a = SimpleNamespace(seq_id=0, pages=[4, 5, 6], num_computed=10, tokens=list(range(11)))
    b = SimpleNamespace(seq_id=1, pages=[4, 7], num_computed=6, tokens=list(range(7)))
    sender, receiver = RowSender(), RowReceiver()

    def step(prefill, decode):
        message = pickle.loads(pickle.dumps(sender.message(ScheduledBatch(prefill, decode), [])))
        got = receiver.batch(message)
        for view, seq in zip([v for v, _ in got.prefill] + got.decode, [s for s, _ in prefill] + decode):
            assert (view.seq_id, view.pages, view.num_computed) == (seq.seq_id, seq.pages, seq.num_computed)
            assert view.num_tokens == len(seq.tokens)
            assert view.tokens[seq.num_computed:] == seq.tokens[seq.num_computed:]
        return message

    assert step([(b, 1)], [a]).decode[0][3] == 0  # first time: whole
    a.pages.append(8)
    a.num_computed, b.num_computed = 11, 7
    a.tokens.append(11)
    b.tokens.append(7)
    assert step([], [a, b]).decode[0][3:] == (2, [6, 8])  # from the last page sent on
    a.pages[-1] = 9  # copy-on-write of the last page
    b.pages = [4, 7, 10]  # a new list (a fork, a re-admission)
    assert step([], [a, b]).decode[1][3] == 0
    step([], [b])  # a left out: forgotten by both sides
    a.pages.append(11)
    assert step([], [a, b]).decode[0][3] == 0
    del b.pages[1:]  # the same list, shorter: sent whole
    assert step([], [a, b]).decode[1][3] == 0


def test_tensor_parallel_beam_search_gives_the_same_beams(tmp_path, monkeypatch):
    """Beam search on TP=2: the beams' forks, prunes and copy-on-write copies reach the
    worker's pool, and the beams equal TP=1's."""
    from test_engine import SHARED, UNSHARED, _tiny  # noqa: PLC0415

    from cascadeinfer.engine import LLM, BeamSearchParams  # noqa: PLC0415

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _tiny("llama", tmp_path, eos_token_id=3)
    kw = dict(device="cpu", dtype=torch.float32, page_size=4, num_pages=96)
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    one = LLM(tmp_path, **kw).beam_search(SHARED + UNSHARED, params)
    llm = LLM(tmp_path, tensor_parallel_size=2, **kw)
    try:
        two = llm.beam_search(SHARED + UNSHARED, params)
        assert llm.cache.copies > 0
    finally:
        llm.close()
    assert [[s.tokens for s in o.sequences] for o in two] == [[s.tokens for s in o.sequences] for o in one]


def test_captured_steps_are_freed_before_the_workers_stop():
    """NCCL's teardown waits for every CUDA graph that captured its collectives: closing a
    tensor-parallel engine frees its captured steps first, then stops the workers."""
    from types import SimpleNamespace  # noqa: PLC0415

    from cascadeinfer.engine.llm import _stop_workers  # noqa: PLC0415

    order = []
    runner = SimpleNamespace(graphs=SimpleNamespace(release=lambda: order.append("graphs")))
    _stop_workers(SimpleNamespace(close=lambda: order.append("workers")), runner)
    assert order == ["graphs", "workers"]


def test_tensor_parallel_engine_stops_when_a_worker_dies(tmp_path, monkeypatch):
    from test_engine import GREEDY, SHARED, _tiny  # noqa: PLC0415

    from cascadeinfer.engine import LLM, SamplingParams  # noqa: PLC0415

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("CASCADEINFER_TP_TIMEOUT_S", "30")
    _tiny("llama", tmp_path)
    llm = LLM(tmp_path, tensor_parallel_size=2, device="cpu", dtype=torch.float32, page_size=4, num_pages=96)
    try:
        llm.generate(SHARED[:1], SamplingParams(max_tokens=2, **GREEDY))
        worker = llm._workers._procs[0]
        worker.kill()
        worker.join(10)
        with pytest.raises(RuntimeError, match="tensor parallelism: worker"):
            llm.generate(SHARED[:1], SamplingParams(max_tokens=2, **GREEDY))
    finally:
        llm.close()


def test_tensor_parallel_size_must_divide_the_heads(tmp_path):
    from test_engine import _tiny  # noqa: PLC0415

    from cascadeinfer.engine import LLM  # noqa: PLC0415

    _tiny("llama", tmp_path)  # 4 query heads over 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 does not divide the model's num_kv_heads"):
        LLM(tmp_path, tensor_parallel_size=4, device="cpu", dtype=torch.float32)


def test_bench_distributed_smoke(tmp_path):
    """benchmarks/bench_distributed.py runs (2 CPU processes, tiny shapes): each rank checks
    the context-parallel output against the one-process cascade before timing it."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_distributed", "--smoke", "--json", str(out)],
                          cwd=root, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["world"], r["batch"]) for r in rows} == {(1, 1), (1, 3), (2, 1), (2, 3)}
    assert all(r["max_err"] < 1e-4 for r in rows)


_TORCHRUN_SCRIPT = """
import json, sys, torch
from cascadeinfer.engine import LLM, SamplingParams
path, out, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(path, tensor_parallel_size=2, device="cpu", dtype=torch.float32, page_size=4, num_pages=96)
# Only rank 0 gets here: the other rank served its steps inside LLM(...) and has ended.
outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
json.dump([o.outputs[0].token_ids for o in outs], open(out, "w"))
llm.close()
"""


def test_tensor_parallel_engine_under_torchrun(tmp_path):
    """Launched by torchrun (2 CPU processes), every rank runs the same script: LLM(...)
    on rank 1 serves rank 0's steps, and rank 0's tokens equal one process's."""
    import json  # noqa: PLC0415
    import socket  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from test_engine import SHARED, UNSHARED, _tiny  # noqa: PLC0415

    from cascadeinfer.engine import LLM, SamplingParams  # noqa: PLC0415

    _tiny("llama", tmp_path / "model")
    prompts = SHARED[:2] + UNSHARED[:1]
    script, out = tmp_path / "run.py", tmp_path / "tokens.json"
    script.write_text(_TORCHRUN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "TRITON_INTERPRET": "0", "CASCADEINFER_TP_TIMEOUT_S": "60"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(port), str(script),
                           str(tmp_path / "model"), str(out), json.dumps(prompts)],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        one = LLM(tmp_path / "model", device="cpu", dtype=torch.float32, page_size=4, num_pages=96).generate(
            prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert json.loads(out.read_text()) == [o.outputs[0].token_ids for o in one]


@pytest.mark.gpu
def test_nccl_world_of_one_runs_the_same_path(tmp_path):
    """On one GPU: NCCL with one rank through merge_states_across and the context-parallel
    cascade, eagerly and replayed from a CUDA graph (the all-gather inside the capture)."""
    from test_cascade import tables  # noqa: PLC0415

    from cascadeinfer import MultiLevelCascadeAttention  # noqa: PLC0415

    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1,
                            device_id=dev)
    try:
        o, lse = torch.randn(8, 4, 64, device=dev), torch.randn(8, 4, device=dev)
        merged, merged_lse = merge_states_across(o, lse)
        torch.testing.assert_close(merged, o)
        torch.testing.assert_close(merged_lse, lse)
        levels = [dict(lens=[40], pages=[[0, 1, 2]], counts=[3], groups=[0, 0, 0]),
                  dict(lens=[5, 16, 1], pages=[[3], [4], [5]], counts=[1, 1, 1], groups=[0, 1, 2])]
        perm = list(range(8))
        tabs = tables(levels, 16, perm, dev)
        cache = torch.randn(8, 2, 16, 2, 64, device=dev, dtype=torch.bfloat16)
        q = torch.randn(3, 4, 64, device=dev, dtype=torch.bfloat16)
        cp = MultiLevelCascadeAttention(2, device=dev, context_parallel_level=0)
        cp.plan(*tabs, 4, 2, 64, 16, num_pages=8)
        whole = MultiLevelCascadeAttention(2, device=dev)
        whole.plan(*tabs, 4, 2, 64, 16, num_pages=8, use_cascade=True)
        expected = whole.run(q, cache)
        out = torch.empty_like(q)
        cp.run(q, cache, out=out)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
        replayed = _replayed(lambda: cp.run(q, cache, out=out), out)
        torch.testing.assert_close(replayed.float(), expected.float(), atol=2e-2, rtol=2e-2)
    finally:
        dist.destroy_process_group()


# ---- NCCL on 2 and 4 GPUs


@pytest.mark.gpu
@pytest.mark.parametrize("world", NCCL_WORLDS)
def test_nccl_merge_states_across(world):
    for dtype in (torch.float32, torch.bfloat16):
        run_ranks(_body_equals_attention_over_all_keys, 11, dtype, "nccl", world=world, backend="nccl")
    run_ranks(_body_lse_gaps, "nccl", world=world, backend="nccl")


@pytest.mark.gpu
@pytest.mark.parametrize("world", NCCL_WORLDS)
def test_nccl_context_parallel_cascade(world):
    """Each GPU its share of a level's pages (bf16), eagerly and replayed from a CUDA graph
    with the all-gather inside: the one-GPU cascade's answer and the float64 reference's."""
    run_ranks(_body_context_parallel, _CP_CASES, "nccl", world=world, backend="nccl")


@pytest.mark.gpu
@pytest.mark.parametrize("world", NCCL_WORLDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tensor_parallel_engine_on_gpus(arch, world, tmp_path):
    """TP=2 and TP=4 over NCCL, decode steps captured in CUDA graphs with their all-reduces
    inside: greedy tokens equal TP=1's on one GPU and transformers'. The tiny model has
    as many KV heads as ranks (4 query heads), so each GPU holds one."""
    from test_engine import GREEDY, SHARED, UNSHARED, _tiny, hf_greedy  # noqa: PLC0415

    from cascadeinfer.engine import LLM, SamplingParams  # noqa: PLC0415

    model = _tiny(arch, tmp_path, num_key_value_heads=world)
    prompts = SHARED + UNSHARED
    params = [SamplingParams(max_tokens=6 + i, n=2 if i == 1 else 1, **GREEDY) for i in range(len(prompts))]
    kw = dict(device="cuda:0", dtype=torch.float32, page_size=4, num_pages=96, record_steps=True)
    one = [[s.token_ids for s in o.outputs] for o in LLM(tmp_path, **kw).generate(prompts, params)]
    llm = LLM(tmp_path, tensor_parallel_size=world, **kw)
    try:
        many = [[s.token_ids for s in o.outputs] for o in llm.generate(prompts, params)]
        assert any(s.graph for s in llm.step_stats)
        assert llm.cache.copies > 0
    finally:
        llm.close()
    assert many == one
    for prompt, p, outs in zip(prompts, params, many):
        assert all(t == hf_greedy(model, prompt, p.max_tokens, "cuda:0") for t in outs)


def test_bench_reports_the_all_reduce_time(tmp_path, monkeypatch):
    """``cascadeinfer bench --tensor-parallel-size 2`` (2 CPU processes): the decode step's
    all-reduces timed on both ranks, beside the step; ``--num-layers`` cuts a preset."""
    import json  # noqa: PLC0415

    from cascadeinfer.engine.cli import main  # noqa: PLC0415

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = tmp_path / "bench.json"
    assert main(["bench", "--preset", "tiny", "--num-layers", "1", "--requests", "3", "--prefix", "9", "--suffix",
                 "3", "--new-tokens", "4", "--page-size", "4", "--device", "cpu", "--modes", "cascade",
                 "--tensor-parallel-size", "2", "--skip-check", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["workload"]["num_layers"] == 1 and result["workload"]["tensor_parallel_size"] == 2
    row = result["rows"][0]
    assert 0 < row["all_reduce_ms"] and row["all_reduce_share_of_step"] > 0
    with pytest.raises(SystemExit, match="--num-layers"):
        main(["bench", "--preset", "tiny", "--num-layers", "0", "--device", "cpu"])
