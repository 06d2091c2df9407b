"""The C++ paged attention kernel against its plain-torch twin, on scattered pool slots."""

from __future__ import annotations

import pytest
import torch

from dflash_sglang.kernels import cpu_attention, cpu_build

HAS_AVX512 = cpu_attention.NEEDS <= cpu_build.cpu_flags()
pytestmark = pytest.mark.skipif(not HAS_AVX512, reason="the kernel is AVX-512 only")

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


def make_inputs(
    q_lens: list[int],
    kv_lens: list[int],
    heads: int = 9,
    kv_heads: int = 3,
    dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> dict:
    """A pool with NaN in every slot no request owns: reading one poisons the output."""
    gen = torch.Generator().manual_seed(seed)
    pool_slots = sum(kv_lens) + 64
    k_buffer = torch.full((pool_slots, kv_heads, dim), float("nan"), dtype=dtype)
    v_buffer = torch.full((pool_slots, kv_heads, dim), float("nan"), dtype=dtype)
    owned = torch.randperm(pool_slots, generator=gen)[: sum(kv_lens)]
    k_buffer[owned] = torch.randn(len(owned), kv_heads, dim, generator=gen).to(dtype)
    v_buffer[owned] = torch.randn(len(owned), kv_heads, dim, generator=gen).to(dtype)
    # Columns past a request's length hold a slot nobody owns, as a recycled row would.
    free = torch.ones(pool_slots, dtype=torch.bool).index_fill_(0, owned, False)
    unowned = int(free.nonzero()[0])
    table = torch.full((len(kv_lens), max(kv_lens) + 3), unowned, dtype=torch.long)
    for b, slots in enumerate(owned.split(kv_lens)):
        table[b, : len(slots)] = slots
    lens = torch.tensor(q_lens)
    return dict(
        q=torch.randn(sum(q_lens), heads, dim, generator=gen).to(dtype),
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        slot_table=table,
        kv_lens=torch.tensor(kv_lens),
        q_lens=lens,
        q_starts=torch.cumsum(lens, 0) - lens,
        scale=dim**-0.5,
    )


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_attention.available(), "the kernel must build on an AVX-512 machine (see log)"


BATCHES = {
    "decode-alone": ([1], [300]),
    "decode": ([1, 1, 1, 1], [7, 129, 1, 64]),
    "verify": ([4, 4, 4], [9, 40, 20]),
    "ragged": ([1, 8, 3, 2], [1, 33, 17, 250]),
    "one-key-per-row": ([5], [5]),
    # Whole 16-key blocks with no tail, and a tail of one (the scores go 16 keys at a time).
    "key-blocks": ([8, 2, 1], [16, 32, 17]),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "layout",
    [(9, 3, 64), (8, 8, 64), (16, 2, 128), (4, 1, 128)],
    ids=["gqa3-64", "mha-64", "gqa8-128", "mqa-128"],
)
@pytest.mark.parametrize("batch", BATCHES)
def test_matches_torch_twin(batch: str, layout: tuple, dtype: torch.dtype, causal: bool) -> None:
    heads, kv_heads, dim = layout
    inputs = make_inputs(*BATCHES[batch], heads, kv_heads, dim, dtype)
    out = cpu_attention.paged_attention(**inputs, causal=causal)
    expected = cpu_attention.torch_paged_attention(**inputs, causal=causal)
    assert out.dtype == dtype and out.shape == expected.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def test_causal_rows_see_keys_up_to_their_position() -> None:
    """The last row of a causal block sees every key, as a non-causal row does; the first
    row sees the prefix and itself only."""
    inputs = make_inputs([4], [10], dtype=torch.float32)
    causal = cpu_attention.paged_attention(**inputs, causal=True)
    full = cpu_attention.paged_attention(**inputs, causal=False)
    torch.testing.assert_close(causal[-1], full[-1])
    prefix = dict(
        inputs, kv_lens=torch.tensor([7]), q_lens=torch.tensor([1]), q=inputs["q"][:1].contiguous()
    )
    torch.testing.assert_close(
        causal[0], cpu_attention.paged_attention(**prefix, causal=True)[0], atol=1e-6, rtol=1e-6
    )


def test_a_request_gets_the_same_bits_alone_or_in_a_batch() -> None:
    """Each (request, KV head) is computed on its own, so batch composition cannot change a
    request's output: lossless serving compares a request against itself run alone."""
    inputs = make_inputs([1, 4, 2], [50, 90, 20])
    batched = cpu_attention.paged_attention(**inputs, causal=True)
    alone = dict(
        inputs,
        q=inputs["q"][1:5].contiguous(),
        slot_table=inputs["slot_table"][1:2],
        kv_lens=inputs["kv_lens"][1:2],
        q_lens=inputs["q_lens"][1:2],
        q_starts=torch.tensor([0]),
    )
    assert torch.equal(cpu_attention.paged_attention(**alone, causal=True), batched[1:5])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda i: dict(i, q=i["q"].float()), "dtype"),
        (lambda i: dict(i, q_lens=torch.tensor([1, 200]), q=i["q"].repeat(200, 1, 1)), "q_len"),
        (lambda i: dict(i, slot_table=i["slot_table"].int()), "int64"),
        (lambda i: dict(i, kv_lens=i["kv_lens"][:1]), "[bs]"),
    ],
    ids=["dtype-mismatch", "more-rows-than-keys", "int32-slots", "short-lengths"],
)
def test_bad_inputs_are_refused_with_a_reason(change, message: str) -> None:
    inputs = change(make_inputs([1, 1], [10, 20]))
    with pytest.raises(RuntimeError, match=message):
        cpu_attention.paged_attention(**inputs, causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_kv_equals_index_put(dtype: torch.dtype) -> None:
    """Rows from a fused QKV output (token stride wider than a row) land where `[loc] =`
    puts them, and nowhere else."""
    gen = torch.Generator().manual_seed(3)
    tokens, kv_heads, dim = 5, 3, 64
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * dim, generator=gen).to(dtype)
    k = qkv[:, 9 * dim : (9 + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (9 + kv_heads) * dim :].view(tokens, kv_heads, dim)
    loc = torch.tensor([7, 0, 31, 12, 8])
    buffers = [torch.randn(32, kv_heads, dim, generator=gen).to(dtype) for _ in range(2)]
    expected = [b.clone() for b in buffers]
    expected[0][loc], expected[1][loc] = k, v
    cpu_attention.store_kv(k, v, *buffers, loc.int())
    assert torch.equal(buffers[0], expected[0]) and torch.equal(buffers[1], expected[1])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: dict(a, loc=torch.tensor([0, 40])), "outside the pool"),
        (lambda a: dict(a, loc=torch.tensor([-1, 0])), "outside the pool"),
        (lambda a: dict(a, k=a["k"].float()), "dtype"),
        (lambda a: dict(a, loc=torch.tensor([0])), "one row per token"),
        (lambda a: dict(a, k=a["k"].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
    ],
    ids=["past-the-pool", "negative", "dtype-mismatch", "short-loc", "strided-rows"],
)
def test_store_kv_refuses_bad_inputs(change, message: str) -> None:
    args = dict(
        k=torch.randn(2, 3, 64).bfloat16(),
        v=torch.randn(2, 3, 64).bfloat16(),
        k_buffer=torch.zeros(40, 3, 64).bfloat16(),
        v_buffer=torch.zeros(40, 3, 64).bfloat16(),
        loc=torch.tensor([1, 2]),
    )
    untouched = args["k_buffer"].clone()
    args = change(args)
    with pytest.raises(RuntimeError, match=message):
        cpu_attention.store_kv(**args)
    assert torch.equal(args["k_buffer"], untouched)
