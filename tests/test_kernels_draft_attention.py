"""The split draft attention (`kernels.draft_attention`, `kernels.flashinfer_draft`).

On CPU: the layout against a per-request loop, the merge maths, and the split pass (torch
twins of FlashInfer's wrappers) against plain attention over context + block — the
attention upstream's paged pass computes after writing the block into the cache. The
backend's own glue (planning per step, per captured batch size, no cache writes) runs here
with the twins in place of FlashInfer; with CUDA the real wrappers meet the twins.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from sglang.srt.layers.radix_attention import AttentionType

from dflash_sglang.kernels import flashinfer_draft
from dflash_sglang.kernels.draft_attention import (
    TorchPagedWrapper,
    TorchRaggedWrapper,
    attention_lse,
    draft_layout,
    merge_states,
)
from dflash_sglang.kernels.flashinfer_draft import (
    DraftFlashInferBackend,
    Heads,
    SplitDraftAttention,
    Wrappers,
)

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 8


def _pools(slots: int, reqs: int, width: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    req_to_token = torch.randperm(reqs * width, generator=gen).view(reqs, width).to(torch.int32)
    k_cache = torch.randn(slots, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(slots, KV_HEADS, DIM, generator=gen)
    return req_to_token, k_cache, v_cache


def test_layout_lists_each_requests_committed_context():
    req_to_token, _, _ = _pools(64, 4, 16)
    req_pool_indices = torch.tensor([3, 0, 2])
    committed = torch.tensor([5, 1, 9])
    layout = draft_layout(req_to_token, req_pool_indices, committed + BLOCK, BLOCK)

    assert layout.batch_size == 3 and layout.block_size == BLOCK
    assert layout.qo_indptr.tolist() == [0, 8, 16, 24]
    assert layout.context_indptr.tolist() == [0, 5, 6, 15]
    pairs = zip(req_pool_indices, committed, strict=True)
    expected = torch.cat([req_to_token[r, :n] for r, n in pairs])
    assert torch.equal(layout.context_indices, expected)
    assert layout.context_indices.dtype == torch.int32
    assert layout.last_page_len.tolist() == [1, 1, 1]
    assert not layout.qo_indptr.is_cuda and not layout.context_indptr.is_cuda


def test_layout_of_rows_padded_by_a_graph_runner_is_empty():
    req_to_token, _, _ = _pools(64, 4, 16)
    # A CUDA graph runner pads with its fill value (1 < block): no context, zero pages.
    layout = draft_layout(req_to_token, torch.tensor([1, 0]), torch.tensor([3 + BLOCK, 1]), BLOCK)
    assert layout.context_indptr.tolist() == [0, 3, 3]
    assert layout.last_page_len.tolist() == [1, 0]
    assert torch.equal(layout.context_indices, req_to_token[1, :3])


def test_merging_two_key_sets_equals_attention_over_their_union():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(6, HEADS, DIM, generator=gen)
    k = torch.randn(11, KV_HEADS, DIM, generator=gen)
    v = torch.randn(11, KV_HEADS, DIM, generator=gen)
    scale = DIM**-0.5
    whole, s_whole = attention_lse(q, k, v, scale)
    a, s_a = attention_lse(q, k[:4], v[:4], scale)
    b, s_b = attention_lse(q, k[4:], v[4:], scale)
    merged, s = merge_states(a, s_a, b, s_b)
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_whole, atol=1e-5, rtol=1e-5)

    # A side without keys (-inf) weighs nothing.
    empty, s_empty = attention_lse(q, k[:0], v[:0], scale)
    assert torch.isneginf(s_empty).all()
    merged, s = merge_states(whole, s_whole, empty, s_empty)
    torch.testing.assert_close(merged, whole)
    torch.testing.assert_close(s, s_whole)


def test_lse_is_base_two_as_flashinfers():
    q = torch.zeros(1, 1, 4)
    k = torch.zeros(3, 1, 4)
    _, s = attention_lse(q, k, torch.zeros(3, 1, 4), 1.0)  # three equal scores of 0
    torch.testing.assert_close(s, torch.full((1, 1), torch.log2(torch.tensor(3.0)).item()))


def _layer(layer_id: int = 0, attn_type=AttentionType.ENCODER_ONLY):
    return SimpleNamespace(
        layer_id=layer_id, tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS, tp_v_head_num=KV_HEADS,
        head_dim=DIM, v_head_dim=DIM, scaling=DIM**-0.5, logit_cap=0.0,
        k_scale_float=None, v_scale_float=None, attn_type=attn_type,
    )  # fmt: skip


def _reference(q, k, v, req_to_token, req_pool_indices, committed, k_cache, v_cache):
    """Non-causal SDPA of each request's block over its context followed by its block."""
    outs = []
    for i, (r, n) in enumerate(zip(req_pool_indices.tolist(), committed.tolist(), strict=True)):
        rows = slice(i * BLOCK, (i + 1) * BLOCK)
        slots = req_to_token[r, :n].long()
        keys = torch.cat([k_cache[slots], k[rows]]).transpose(0, 1)
        values = torch.cat([v_cache[slots], v[rows]]).transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), keys, values, enable_gqa=True, scale=DIM**-0.5
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs).reshape(-1, HEADS * DIM)


def _twins() -> Wrappers:
    return Wrappers(TorchRaggedWrapper(), TorchPagedWrapper())


def _split() -> SplitDraftAttention:
    return SplitDraftAttention(Heads(HEADS, KV_HEADS, DIM, torch.float32, torch.float32))


@pytest.mark.parametrize("committed", [[5, 1, 9], [1], [12, 12]])
def test_split_pass_equals_attention_over_context_and_block(committed):
    req_to_token, k_cache, v_cache = _pools(64, 4, 16, seed=len(committed))
    committed = torch.tensor(committed)
    req_pool_indices = torch.tensor([3, 0, 2][: len(committed)])
    bs = len(committed)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(bs * BLOCK, HEADS * DIM, generator=gen)
    k = torch.randn(bs * BLOCK, KV_HEADS * DIM, generator=gen)
    v = torch.randn(bs * BLOCK, KV_HEADS * DIM, generator=gen)

    split = _split()
    layout = draft_layout(req_to_token, req_pool_indices, committed + BLOCK, BLOCK)
    wrappers = split.plan(_twins(), layout)
    out = split.run(wrappers, q, k, v, _layer(), (k_cache, v_cache))

    q3, k3, v3 = q.view(-1, HEADS, DIM), k.view(-1, KV_HEADS, DIM), v.view(-1, KV_HEADS, DIM)
    expected = _reference(q3, k3, v3, req_to_token, req_pool_indices, committed, k_cache, v_cache)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _backend(req_to_token, k_cache, v_cache) -> DraftFlashInferBackend:
    """The backend without FlashInferAttnBackend's CUDA-only constructor: the split state
    it builds, with the torch twins for FlashInfer."""
    backend = object.__new__(DraftFlashInferBackend)
    backend._req_to_token = req_to_token
    backend._context_len = req_to_token.shape[1]
    backend._split = _split()
    backend._eager = _twins()
    backend._graph = {}
    backend._graph_indices = None
    backend._step = None
    backend.workspace_buffer = torch.empty(0, dtype=torch.uint8)
    backend.token_to_kv_pool = SimpleNamespace(get_kv_buffer=lambda layer_id: (k_cache, v_cache))
    return backend


def _draft_batch(req_pool_indices, committed, padded_bs=None):
    bs = padded_bs or len(committed)
    seq_lens_cpu = torch.ones(bs, dtype=torch.int64)  # padding: a graph runner's fill value
    seq_lens_cpu[: len(committed)] = committed + BLOCK
    rpi = torch.zeros(bs, dtype=torch.int64)
    rpi[: len(committed)] = req_pool_indices
    return SimpleNamespace(
        forward_mode=SimpleNamespace(is_target_verify=lambda: True),
        batch_size=bs, req_pool_indices=rpi, seq_lens_cpu=seq_lens_cpu,
        positions=torch.zeros(bs * BLOCK, dtype=torch.int64),
    )  # fmt: skip


def test_backend_plans_once_per_step_and_never_writes_the_draft_cache(monkeypatch):
    req_to_token, k_cache, v_cache = _pools(64, 4, 16, seed=3)
    before = (k_cache.clone(), v_cache.clone())
    backend = _backend(req_to_token, k_cache, v_cache)
    committed, rpi = torch.tensor([4, 7]), torch.tensor([1, 2])
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2 * BLOCK, HEADS * DIM, generator=gen)
    k = torch.randn(2 * BLOCK, KV_HEADS * DIM, generator=gen)
    v = torch.randn(2 * BLOCK, KV_HEADS * DIM, generator=gen)
    q3, k3, v3 = q.view(-1, HEADS, DIM), k.view(-1, KV_HEADS, DIM), v.view(-1, KV_HEADS, DIM)
    expected = _reference(q3, k3, v3, req_to_token, rpi, committed, k_cache, v_cache)

    fb = _draft_batch(rpi, committed)
    backend.init_forward_metadata(fb)
    assert backend._step is backend._eager
    for layer_id in range(3):  # every layer reuses the step's plan
        out = backend.forward_extend(q, k, v, _layer(layer_id), fb, save_kv_cache=True)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])

    # Under CUDA graphs: a wrapper pair per captured batch size, planned before replay,
    # here with a padded row.
    made = []
    monkeypatch.setattr(
        flashinfer_draft, "make_wrappers", lambda *a: made.append(a[1:]) or _twins()
    )
    fb = _draft_batch(rpi, committed, padded_bs=3)
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    backend.init_forward_metadata_out_graph(fb)  # a replay reuses the pair
    assert made == [(3, None)] and backend._step is backend._graph[3]
    pad = torch.zeros(BLOCK, q.shape[1])
    out = backend.forward_extend(
        torch.cat([q, pad]), torch.cat([k, pad[:, : k.shape[1]]]),
        torch.cat([v, pad[:, : v.shape[1]]]), _layer(), fb,
    )  # fmt: skip
    torch.testing.assert_close(out[: 2 * BLOCK], expected, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


def test_backend_refuses_causal_layers():
    req_to_token, k_cache, v_cache = _pools(64, 4, 16)
    backend = _backend(req_to_token, k_cache, v_cache)
    fb = _draft_batch(torch.tensor([0]), torch.tensor([3]))
    backend.init_forward_metadata(fb)
    x = torch.zeros(BLOCK, HEADS * DIM)
    with pytest.raises(RuntimeError, match="non-causal"):
        backend.forward_extend(x, x[:, : KV_HEADS * DIM], x[:, : KV_HEADS * DIM],
                               _layer(attn_type=AttentionType.DECODER), fb)  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graph", [False, True])
def test_flashinfer_wrappers_match_the_torch_twins(graph):
    from flashinfer import merge_state

    device = "cuda"
    req_to_token, k_cache, v_cache = _pools(4096, 4, 1024, seed=11)
    req_to_token = req_to_token.to(device)
    k_cache, v_cache = k_cache.to(device, torch.bfloat16), v_cache.to(device, torch.bfloat16)
    committed, rpi = torch.tensor([700, 1, 313]), torch.tensor([2, 0, 3], device=device)
    gen = torch.Generator(device=device).manual_seed(5)
    q = torch.randn(3 * BLOCK, HEADS * DIM, generator=gen, device=device, dtype=torch.bfloat16)
    k = torch.randn(3 * BLOCK, KV_HEADS * DIM, generator=gen, device=device, dtype=torch.bfloat16)
    v = torch.randn(3 * BLOCK, KV_HEADS * DIM, generator=gen, device=device, dtype=torch.bfloat16)
    layout = draft_layout(req_to_token, rpi, committed + BLOCK, BLOCK)
    heads = Heads(HEADS, KV_HEADS, DIM, torch.bfloat16, torch.bfloat16)

    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    indices = torch.zeros(3 * 1024, dtype=torch.int32, device=device)
    real = flashinfer_draft.make_wrappers(workspace, 3 if graph else None, indices)
    ours = SplitDraftAttention(heads, merge=merge_state)
    out = ours.run(ours.plan(real, layout), q, k, v, _layer(), (k_cache, v_cache))

    twin = SplitDraftAttention(heads)
    expected = twin.run(twin.plan(_twins(), layout), q, k, v, _layer(), (k_cache, v_cache))
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
