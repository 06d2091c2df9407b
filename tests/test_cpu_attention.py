"""The `dflash_cpu` attention backend against a per-request matmul + softmax reference.

Runs on SGLang's real KV pools with scattered (non-contiguous) slots, so the paging and
the padding are exercised the way a server exercises them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from dflash_sglang import cpu_platform
from dflash_sglang.cpu_platform import install_sgl_kernel_shim

os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
install_sgl_kernel_shim()

from sglang.srt.arg_groups import choices  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

from dflash_sglang import backends  # noqa: E402
from dflash_sglang.cpu_platform import attention  # noqa: E402
from dflash_sglang.kernels import cpu_attention  # noqa: E402

torch.set_num_threads(1)

POOL_SLOTS = 512
MAX_CONTEXT = 64
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclass
class Case:
    """One forward: backend, layer, batch, inputs, and the dense per-request K/V."""

    backend: attention.DFlashCPUAttnBackend
    layer: RadixAttention
    batch: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    new_lens: list[int]


def make_layer(heads=4, kv_heads=2, head_dim=16, v_head_dim=-1, **kwargs) -> RadixAttention:
    return RadixAttention(
        num_heads=heads,
        head_dim=head_dim,
        scaling=head_dim**-0.5,
        num_kv_heads=kv_heads,
        layer_id=0,
        v_head_dim=v_head_dim,
        **kwargs,
    )


def make_case(
    mode: ForwardMode,
    prefix_lens: list[int],
    new_lens: list[int],
    dtype: torch.dtype = torch.float32,
    layer: RadixAttention | None = None,
    seed: int = 0,
) -> Case:
    """Pools with each request's prefix already cached at random slots, plus new tokens.

    Stale slots whose KV is NaN are left in `req_to_token` past every request's end, as a
    recycled request row would have; correct masking and padding must never read them.
    """
    layer = layer or make_layer()
    gen = torch.Generator().manual_seed(seed)
    kv_heads, head_dim, v_dim = layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
    kv_pool = MHATokenToKVPool(
        size=POOL_SLOTS,
        page_size=1,
        dtype=dtype,
        head_num=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_dim,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    req_pool = ReqToTokenPool(
        size=8, max_context_len=MAX_CONTEXT, device="cpu", enable_memory_saver=False
    )
    free_slots = (torch.randperm(POOL_SLOTS, generator=gen) + 1).tolist()
    stale = free_slots.pop()
    kv_pool.get_key_buffer(0)[stale] = float("nan")
    kv_pool.get_value_buffer(0)[stale] = float("nan")

    def rand(n: int, heads: int, dim: int) -> torch.Tensor:
        return torch.randn(n, heads, dim, generator=gen).to(dtype)

    pool_rows = [5, 2, 7, 0, 3][: len(prefix_lens)]
    keys, values, out_loc = [], [], []
    for row, prefix, new in zip(pool_rows, prefix_lens, new_lens, strict=True):
        slots = torch.tensor([free_slots.pop() for _ in range(prefix + new)])
        req_pool.req_to_token[row, :] = stale
        req_pool.req_to_token[row, : prefix + new] = slots.int()
        keys.append(rand(prefix + new, kv_heads, head_dim))
        values.append(rand(prefix + new, kv_heads, v_dim))
        kv_pool.get_key_buffer(0)[slots[:prefix]] = keys[-1][:prefix]
        kv_pool.get_value_buffer(0)[slots[:prefix]] = values[-1][:prefix]
        out_loc.append(slots[prefix:])

    prefix_t, new_t = torch.tensor(prefix_lens), torch.tensor(new_lens)
    total_lens = prefix_t + new_t
    extra: dict = {}
    if mode == ForwardMode.TARGET_VERIFY:
        assert len(set(new_lens)) == 1
        seq_lens = prefix_t
        extra["spec_info"] = SimpleNamespace(draft_token_num=new_lens[0], custom_mask=None)
    else:
        seq_lens = total_lens
    if mode == ForwardMode.EXTEND:
        extra.update(
            extend_prefix_lens=prefix_t,
            extend_seq_lens=new_t,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=new_lens,
        )
    num_tokens = sum(new_lens)
    batch = ForwardBatch(
        forward_mode=mode,
        batch_size=len(new_lens),
        input_ids=torch.zeros(num_tokens, dtype=torch.long),
        req_pool_indices=torch.tensor(pool_rows),
        seq_lens=seq_lens,
        out_cache_loc=torch.cat(out_loc),
        seq_lens_sum=int(seq_lens.sum()),
        seq_lens_cpu=total_lens,
        **extra,
    )
    backend = attention.DFlashCPUAttnBackend(
        SimpleNamespace(req_to_token_pool=req_pool, token_to_kv_pool=kv_pool)
    )
    q = rand(num_tokens, layer.tp_q_head_num, head_dim).view(num_tokens, -1)
    k = torch.cat([key[p:] for key, p in zip(keys, prefix_lens, strict=True)])
    v = torch.cat([val[p:] for val, p in zip(values, prefix_lens, strict=True)])
    return Case(backend, layer, batch, q, k, v, keys, values, new_lens)


def run(case: Case, save_kv_cache: bool = True, with_kv: bool = True) -> torch.Tensor:
    case.backend.init_forward_metadata(case.batch)
    k, v = (case.k, case.v) if with_kv else (None, None)
    return case.backend.forward(case.q, k, v, case.layer, case.batch, save_kv_cache)


def reference(case: Case, causal: bool, logit_cap: float = 0.0) -> torch.Tensor:
    """Per-request attention in float64 with the new tokens at the end of each sequence."""
    layer = case.layer
    heads, group = layer.tp_q_head_num, layer.tp_q_head_num // layer.tp_k_head_num
    queries = case.q.view(-1, heads, layer.qk_head_dim).double().split(case.new_lens)
    outputs = []
    for q, key, value in zip(queries, case.keys, case.values, strict=True):
        key = key.double().repeat_interleave(group, dim=1)
        value = value.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, key) * layer.scaling
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        if causal:
            query_pos = torch.arange(q.shape[0]) + key.shape[0] - q.shape[0]
            visible = torch.arange(key.shape[0])[None, :] <= query_pos[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), value)
        outputs.append(out.reshape(q.shape[0], -1))
    return torch.cat(outputs)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    assert actual.shape == expected.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected, atol=tol, rtol=tol)


SCENARIOS = {
    "extend": (ForwardMode.EXTEND, [0, 0, 0], [5, 1, 9]),
    "extend-prefix": (ForwardMode.EXTEND, [7, 0, 12, 3], [4, 6, 1, 3]),
    "extend-prefix-aligned": (ForwardMode.EXTEND, [2, 0, 5], [9, 4, 8]),
    "decode": (ForwardMode.DECODE, [7, 19, 1], [1, 1, 1]),
    "verify": (ForwardMode.TARGET_VERIFY, [9, 3, 20], [4, 4, 4]),
    "verify-wide": (ForwardMode.TARGET_VERIFY, [20, 31], [10, 10]),
    "decode-alone": (ForwardMode.DECODE, [12], [1]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("encoder_only", [False, True], ids=["causal", "encoder-only"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_matches_reference(scenario: str, encoder_only: bool, dtype: torch.dtype) -> None:
    mode, prefix_lens, new_lens = SCENARIOS[scenario]
    attn_type = AttentionType.ENCODER_ONLY if encoder_only else AttentionType.DECODER
    case = make_case(mode, prefix_lens, new_lens, dtype, make_layer(attn_type=attn_type))
    assert_matches(run(case), reference(case, causal=not encoder_only), dtype)


@pytest.mark.parametrize(
    "layer_args",
    [
        dict(heads=4, kv_heads=4),
        dict(heads=8, kv_heads=1),
        dict(heads=4, kv_heads=2, head_dim=16, v_head_dim=8),
    ],
    ids=["mha", "mqa", "v-head-dim"],
)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_head_layouts(scenario: str, layer_args: dict) -> None:
    mode, prefix_lens, new_lens = SCENARIOS[scenario]
    case = make_case(mode, prefix_lens, new_lens, layer=make_layer(**layer_args))
    assert_matches(run(case), reference(case, causal=True), torch.float32)


@pytest.mark.parametrize(
    "scenario, aligned, grouped",
    [("extend", True, False), ("extend-prefix-aligned", True, False)]
    + [("extend-prefix", False, True), ("decode", False, True), ("verify", False, True)]
    + [("verify-wide", False, False), ("decode-alone", False, False)],
)
def test_query_grid_choice(scenario: str, aligned: bool, grouped: bool) -> None:
    """Prefill takes the kernel's causal skipping; decode and verify the explicit mask, in
    grouped matmuls when a batch has few query rows per request (SDPA's kernel is slow
    there), in SDPA for wider blocks and a request alone."""
    case = make_case(*SCENARIOS[scenario])
    case.backend.init_forward_metadata(case.batch)
    metadata = case.backend.forward_metadata
    assert metadata.position_aligned is aligned
    # A request alone masks nothing in decode: SDPA's unmasked path.
    assert (metadata.causal_mask is None) is (aligned or scenario == "decode-alone")
    assert metadata.grouped is grouped
    assert metadata.q_rows <= attention.GROUPED_MAX_ROWS or not grouped


def test_sdpa_setting_never_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--dflash-cpu-attention sdpa` (as the launcher hands it down): SDPA for every batch,
    with the same result as the grouped matmuls."""
    grouped = make_case(*SCENARIOS["decode"])
    monkeypatch.setenv(cpu_platform.ATTENTION_ENV, "sdpa")
    case = make_case(*SCENARIOS["decode"])
    out = run(case)
    assert case.backend.forward_metadata.grouped is False
    assert case.backend.forward_metadata.paged is False
    torch.testing.assert_close(out, run(grouped))
    assert grouped.backend.forward_metadata.grouped is True


@pytest.mark.parametrize(
    "kv_lens",
    [[402, 42, 243, 50, 138, 61, 90, 44], [100] * 5, [30, 5, 64, 1], [1000, 900, 10, 700, 3]],
)
def test_length_groups_bound_the_padding(kv_lens: list[int]) -> None:
    """Every request in exactly one group, longest first; each group's grid within the slack
    of its own squares (short requests counted at the floor); equal or short lengths stay
    one grid."""
    groups = attention.length_groups(kv_lens)
    assert sorted(i for g in groups for i in g) == list(range(len(kv_lens)))
    floor = attention.RAGGED_MIN_KEYS
    for group in groups:
        lens = [max(kv_lens[i], floor) for i in group]
        assert lens == sorted(lens, reverse=True)
        assert len(lens) * lens[0] ** 2 <= attention.RAGGED_SLACK * sum(n * n for n in lens)
    if max(kv_lens) <= floor or len(set(kv_lens)) == 1:
        assert len(groups) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scenario", ["extend", "extend-prefix-aligned"])
def test_ragged_prefill_attends_in_groups(
    scenario: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill of unequal lengths (the floor lowered so this test's short requests split)
    is attended group by group, with the reference's result and the one grid's."""
    monkeypatch.setattr(attention, "RAGGED_MIN_KEYS", 1)
    case = make_case(*SCENARIOS[scenario], dtype=dtype)
    out = run(case)
    metadata = case.backend.forward_metadata
    assert metadata.position_aligned and len(metadata.parts) > 1
    assert all(not part.parts for _, part in metadata.parts)
    assert_matches(out, reference(case, causal=True), dtype)
    monkeypatch.setattr(attention, "RAGGED_MIN_KEYS", 1000)  # every request short: one grid
    whole = make_case(*SCENARIOS[scenario], dtype=dtype)
    torch.testing.assert_close(out, run(whole))
    assert not whole.backend.forward_metadata.parts


KERNEL_LAYER = dict(heads=9, kv_heads=3, head_dim=64)  # the embedded SmolLM2's heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("encoder_only", [False, True], ids=["causal", "encoder-only"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_paged_kernel_serves_few_row_batches(
    scenario: str, encoder_only: bool, dtype: torch.dtype
) -> None:
    """The default setting: batches of at most a block's rows per request (a request alone
    too) take the C++ kernel, and every batch still matches the reference."""
    if not cpu_attention.available():
        pytest.skip("the C++ kernel is not built here (tests/test_cpu_paged_attention.py)")
    mode, prefix_lens, new_lens = SCENARIOS[scenario]
    attn_type = AttentionType.ENCODER_ONLY if encoder_only else AttentionType.DECODER
    layer = make_layer(attn_type=attn_type, **KERNEL_LAYER)
    case = make_case(mode, prefix_lens, new_lens, dtype, layer)
    out = run(case)
    metadata = case.backend.forward_metadata
    assert metadata.paged is (not metadata.position_aligned and metadata.q_rows <= 16)
    kernel_scenarios = ("extend-prefix", "decode", "verify", "verify-wide", "decode-alone")
    assert metadata.paged is (scenario in kernel_scenarios)
    assert_matches(out, reference(case, causal=not encoder_only), dtype)


@pytest.mark.parametrize("encoder_only", [False, True], ids=["causal", "encoder-only"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_forward_paged_is_sglangs_path_without_its_dispatch(
    scenario: str, encoder_only: bool
) -> None:
    """The compiled forward's per-layer shortcut writes the same KV and returns the same
    output as the backend's own `forward`, and declines (None) wherever that path would not
    take the kernel: prefill grids, layers the kernel does not fit, a dtype not the pool's."""
    if not cpu_attention.available():
        pytest.skip("the C++ kernel is not built here (tests/test_cpu_paged_attention.py)")
    attn_type = AttentionType.ENCODER_ONLY if encoder_only else AttentionType.DECODER
    layer = make_layer(attn_type=attn_type, **KERNEL_LAYER)
    fast, slow = (make_case(*SCENARIOS[scenario], torch.bfloat16, layer) for _ in range(2))
    for case in (fast, slow):
        case.backend.init_forward_metadata(case.batch)
    out = fast.backend.forward_paged(fast.q, fast.k, fast.v, layer, fast.batch)
    if not fast.backend.forward_metadata.paged:
        assert out is None
        return
    assert torch.equal(out, slow.backend.forward(slow.q, slow.k, slow.v, layer, slow.batch))
    fast_pool, slow_pool = fast.backend.token_to_kv_pool, slow.backend.token_to_kv_pool
    for buffer in ("get_key_buffer", "get_value_buffer"):
        written = getattr(fast_pool, buffer)(0).nan_to_num()  # the stale slot's NaN aside
        assert torch.equal(written, getattr(slow_pool, buffer)(0).nan_to_num())
    assert fast.backend.forward_paged(fast.q.float(), fast.k, fast.v, layer, fast.batch) is None
    capped = make_layer(logit_cap=0.5, **KERNEL_LAYER)
    capped.layer_id = 1  # the backend remembers its verdict per layer
    assert fast.backend.forward_paged(fast.q, fast.k, fast.v, capped, fast.batch) is None


def test_kernel_served_forward_builds_no_masks() -> None:
    """Masks and packed rows are built on first use: a batch every layer serves through the
    kernel never pays for them; the torch path builds them when it first needs them."""
    if not cpu_attention.available():
        pytest.skip("the C++ kernel is not built here (tests/test_cpu_paged_attention.py)")
    case = make_case(*SCENARIOS["verify"], layer=make_layer(**KERNEL_LAYER))
    run(case)
    metadata = case.backend.forward_metadata
    assert metadata.paged
    assert not {"causal_mask", "full_mask", "token_rows"} & set(vars(metadata))
    assert metadata.causal_mask is not None and "causal_mask" in vars(metadata)


def test_grouped_setting_keeps_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--dflash-cpu-attention grouped`: the gathered-KV matmuls, equal to the kernel."""
    layer = make_layer(**KERNEL_LAYER)
    paged = make_case(*SCENARIOS["decode"], layer=layer)
    monkeypatch.setenv(cpu_platform.ATTENTION_ENV, "grouped")
    case = make_case(*SCENARIOS["decode"], layer=layer)
    out = run(case)
    assert case.backend.forward_metadata.paged is False
    assert case.backend.forward_metadata.grouped is True
    torch.testing.assert_close(out, run(paged))
    assert paged.backend.forward_metadata.paged is cpu_attention.available()


def test_single_request_verify_needs_no_padding() -> None:
    case = make_case(ForwardMode.TARGET_VERIFY, [11], [4], layer=make_layer())
    case.backend.init_forward_metadata(case.batch)
    metadata = case.backend.forward_metadata
    assert metadata.full_mask is None and metadata.token_rows is None
    assert metadata.causal_mask is not None
    assert_matches(run(case), reference(case, causal=True), torch.float32)


def test_encoder_only_verify_differs_from_causal() -> None:
    scenario = SCENARIOS["verify"]
    causal = run(make_case(*scenario, layer=make_layer()))
    block = run(make_case(*scenario, layer=make_layer(attn_type=AttentionType.ENCODER_ONLY)))
    rows_per_request = block.view(3, 4, -1)
    # Only the last block token sees the same keys under both masks.
    torch.testing.assert_close(rows_per_request[:, -1], causal.view(3, 4, -1)[:, -1])
    assert not torch.allclose(rows_per_request[:, :-1], causal.view(3, 4, -1)[:, :-1])


@pytest.mark.parametrize("direct", [True, False], ids=["store_kv", "set_kv_buffer"])
def test_verify_writes_block_kv_to_pool(direct: bool) -> None:
    """The C++ `store_kv` (SGLang's plain MHA pool, the kernel built) and SGLang's own
    `set_kv_buffer` leave the same pool."""
    case = make_case(*SCENARIOS["verify"])
    assert case.backend.direct_kv_write is cpu_attention.available()
    if direct and not cpu_attention.available():
        pytest.skip("the C++ kernel is not built here (tests/test_cpu_paged_attention.py)")
    case.backend.direct_kv_write = direct
    run(case)
    pool = case.backend.token_to_kv_pool
    torch.testing.assert_close(pool.get_key_buffer(0)[case.batch.out_cache_loc], case.k)
    torch.testing.assert_close(pool.get_value_buffer(0)[case.batch.out_cache_loc], case.v)


def test_without_kv_reads_what_pool_holds() -> None:
    case = make_case(*SCENARIOS["extend-prefix"])
    expected = reference(case, causal=True)
    with_write = run(case)
    assert_matches(run(case, with_kv=False), expected, torch.float32)
    assert_matches(run(case, save_kv_cache=False), expected, torch.float32)
    torch.testing.assert_close(with_write, run(case, save_kv_cache=False))


def test_save_kv_cache_false_leaves_pool_untouched() -> None:
    case = make_case(*SCENARIOS["decode"])
    before = case.backend.token_to_kv_pool.get_key_buffer(0).clone()
    out = run(case, save_kv_cache=False)
    after = case.backend.token_to_kv_pool.get_key_buffer(0)
    torch.testing.assert_close(after, before, equal_nan=True)
    assert out.shape == (3, 4 * 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scenario", ["extend-prefix", "extend-prefix-aligned"])
def test_logit_cap(scenario: str, dtype: torch.dtype) -> None:
    case = make_case(*SCENARIOS[scenario], dtype=dtype, layer=make_layer(logit_cap=0.5))
    expected = reference(case, causal=True, logit_cap=0.5)
    assert_matches(run(case), expected, dtype)
    assert not torch.allclose(expected, reference(case, causal=True), atol=1e-2)


def test_idle_and_empty_batches() -> None:
    case = make_case(*SCENARIOS["decode"])
    idle = ForwardBatch(
        forward_mode=ForwardMode.IDLE,
        batch_size=0,
        input_ids=torch.empty(0, dtype=torch.long),
        req_pool_indices=torch.empty(0, dtype=torch.long),
        seq_lens=torch.empty(0, dtype=torch.long),
        out_cache_loc=torch.empty(0, dtype=torch.long),
        seq_lens_sum=0,
    )
    case.backend.init_forward_metadata(idle)
    empty_q, empty_kv = torch.empty(0, 64), torch.empty(0, 2, 16)
    assert case.backend.forward(empty_q, empty_kv, empty_kv, case.layer, idle).shape == (0, 64)
    idle.forward_mode = ForwardMode.EXTEND
    out = case.backend.forward_extend(empty_q, empty_kv, empty_kv, case.layer, idle)
    assert out.shape == (0, 64)


@pytest.mark.parametrize(
    "layer_args, feature",
    [
        (dict(sliding_window_size=8), "sliding-window"),
        (dict(is_cross_attention=True), "cross-attention"),
    ],
)
def test_unsupported_features_are_named(layer_args: dict, feature: str) -> None:
    case = make_case(*SCENARIOS["decode"], layer=make_layer(**layer_args))
    with pytest.raises(NotImplementedError, match=feature):
        run(case)


def test_attention_sinks_are_refused() -> None:
    case = make_case(*SCENARIOS["decode"])
    case.backend.init_forward_metadata(case.batch)
    with pytest.raises(NotImplementedError, match="sinks"):
        case.backend.forward(case.q, case.k, case.v, case.layer, case.batch, sinks=torch.zeros(4))


def test_tree_verify_is_refused() -> None:
    case = make_case(*SCENARIOS["verify"])
    case.batch.spec_info.custom_mask = torch.ones(1, dtype=torch.bool)
    with pytest.raises(NotImplementedError, match="custom_mask"):
        case.backend.init_forward_metadata(case.batch)


def _tree_case(prefix_lens: list[int]) -> tuple[Case, torch.Tensor]:
    """A width-4 verify whose rows form a tree per request, and its ancestor mask."""
    from dflash_sglang.suffix import SuffixProposal
    from dflash_sglang.tree import build_tree

    bs = len(prefix_lens)
    case = make_case(ForwardMode.TARGET_VERIFY, prefix_lens, [4] * bs)
    drafts = torch.tensor([[1, 10, 11, 12]] * bs)
    # Request 0: suffix branch off the anchor; 1: off d_1 (shared first token); rest: chains.
    suffix = [SuffixProposal((20, 21), 1, 1), SuffixProposal((10, 30), 1, 1)]
    tree = build_tree(drafts, (suffix + [None] * bs)[:bs], width=4, dflash_len=1)
    case.batch.spec_info.tree = tree
    return case, tree.ancestors()


def tree_reference(case: Case, ancestors: torch.Tensor) -> torch.Tensor:
    """Per-request attention in float64: all prefix keys, and in the block only ancestors."""
    layer = case.layer
    heads, group = layer.tp_q_head_num, layer.tp_q_head_num // layer.tp_k_head_num
    queries = case.q.view(-1, heads, layer.qk_head_dim).double().split(case.new_lens)
    outputs = []
    for r, (q, key, value) in enumerate(zip(queries, case.keys, case.values, strict=True)):
        key = key.double().repeat_interleave(group, dim=1)
        value = value.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, key) * layer.scaling
        prefix = key.shape[0] - q.shape[0]
        visible = torch.ones(q.shape[0], key.shape[0], dtype=torch.bool)
        visible[:, prefix:] = ancestors[r]
        scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), value)
        outputs.append(out.reshape(q.shape[0], -1))
    return torch.cat(outputs)


@pytest.mark.parametrize(
    "prefix_lens", [[9, 3, 20], [3], [2, 6]], ids=["grouped", "alone", "short"]
)
def test_tree_verify_attends_to_ancestors_only(prefix_lens: list[int]) -> None:
    """Each block row sees the whole prefix and, inside the block, its tree ancestors: the
    causal-only C++ kernel and the position-aligned grid (short prefixes) are not used."""
    case, ancestors = _tree_case(prefix_lens)
    out = run(case)
    metadata = case.backend.forward_metadata
    assert not metadata.paged and not metadata.position_aligned
    assert_matches(out, tree_reference(case, ancestors), torch.float32)
    assert not torch.allclose(out.double(), reference(case, causal=True))


def test_causal_mask_places_queries_at_sequence_end() -> None:
    q_lens, kv_lens = torch.tensor([2, 1]), torch.tensor([4, 2])
    mask = attention.attention_mask(q_lens, kv_lens, q_max=3, kv_max=4, causal=True)
    expected = torch.tensor(
        [
            [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]],
            [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[:, 0], expected)
    full = attention.attention_mask(q_lens, kv_lens, q_max=3, kv_max=4, causal=False)
    assert full.shape == (2, 1, 1, 4)
    assert torch.equal(full[:, 0, 0], expected[:, -1])


def test_packed_token_rows_and_slot_padding() -> None:
    q_lens = torch.tensor([2, 0, 3])
    rows = attention.packed_token_rows(q_lens, torch.zeros_like(q_lens), q_rows=3, num_tokens=5)
    assert rows.tolist() == [0, 1, 6, 7, 8]
    shifted = attention.packed_token_rows(q_lens, torch.tensor([1, 0, 2]), q_rows=5, num_tokens=5)
    assert shifted.tolist() == [1, 2, 12, 13, 14]
    req_to_token = torch.arange(40, dtype=torch.int32).view(4, 10)
    slots = attention.kv_slot_table(req_to_token, torch.tensor([2, 0]), torch.tensor([3, 1]), 4)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [[20, 21, 22, 20], [0, 0, 0, 0]]


def test_register_is_idempotent() -> None:
    backends.register()
    backends.register()
    assert ATTENTION_BACKENDS["dflash_cpu"] is backends._cpu
    assert ATTENTION_BACKENDS["dflash_flashinfer"] is backends._flashinfer_draft
    assert choices.ATTENTION_BACKEND_CHOICES.count("dflash_cpu") == 1
    assert choices.DRAFT_ATTENTION_BACKEND_CHOICES.count("dflash_cpu") == 1
    # Draft only: the split pass is the DFlash block's, not a target backend.
    assert "dflash_flashinfer" not in choices.ATTENTION_BACKEND_CHOICES
    assert choices.DRAFT_ATTENTION_BACKEND_CHOICES.count("dflash_flashinfer") == 1


def test_a_source_needing_an_instruction_set_the_cpu_lacks_is_not_compiled(monkeypatch, caplog):
    """Skipped from the CPU's flags, before the compiler runs (~40 s to reach the `#error`)."""
    from dflash_sglang.kernels import cpu_build

    monkeypatch.setattr(cpu_build, "build", lambda *a: pytest.fail("compiled anyway"))
    source = cpu_build.SOURCES / "paged_attention.cpp"
    needs = frozenset({"no_such_isa"})
    assert cpu_build.try_build(source, "probe", "using the torch path", needs) is None
    assert "probe not built (this CPU lacks no_such_isa); using the torch path" in caplog.text
