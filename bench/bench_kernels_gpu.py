"""Our Triton kernels against upstream SGLang's, on the same inputs, timed inside CUDA graphs.

    python bench/bench_kernels_gpu.py --out artifacts/bench_kernels_gpu.json

Every pair's outputs are compared before anything is timed, and each timed op is captured
in a torch.cuda.CUDAGraph whose replay must reproduce its eager outputs; replays are timed
with triton.testing.do_bench (median, L2 flushed between replays), in microseconds.

Arms (ours vs upstream):
  kv_injection     batch x block, Qwen3-8B-like draft (hidden 4096, 5 layers, 8 KV heads of
                   128, bf16; random weights, `tests.draft_kv`), a real MHATokenToKVPool,
                   random commit lengths 1..B, positions up to the largest context.
      ours:      kv_inject.inject_committed: fc + hidden_norm, one stacked K/V GEMM, one
                 launch for k_norm, RoPE and the pool write of committed rows only.
      upstream:  what DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc does on its
                 fused path with `cache_loc_2d` + `commit_lens` (the overlap verify):
                 draft_model.project_target_hidden, then FusedKVMaterializeHelper.materialize
                 (one GEMM, norm + RoPE of every row into a workspace) whose write_layer_kv is
                 MHATokenToKVPool.set_kv_buffer_prefix_valid, one launch per layer.
      compared:  committed slots allclose (bf16: atol 1e-2, rtol 2e-2), every other slot
                 bit-identical to before.
  greedy_accept    batch x block, fp32 logits [bs*B, vocab], drafts matching the argmax up
                   to a random length.
      ours:      accept.greedy_accept from logits into caller buffers: argmax, prefix match,
                 bonus, commit lengths, out tokens in one launch.
      upstream:  torch.argmax, then _compute_dflash_accept_bonus_triton_unchecked into
                 preallocated buffers (the same four outputs plus new_seq_lens), as
                 DFlashWorkerV2._accept_block does.
      compared:  accept lengths, bonus, commit lengths and committed out tokens, exactly.
  sampled_accept   batch x block x setting, fp32 logits, drafts the row's top token 80% of
                   the time, the same uniforms on both sides.
      ours:      accept.sampled_accept without min-p (upstream has none): row filter, then
                 the speculative chain and the residual draw.
      upstream:  compute_dflash_sampling_correct_drafts_and_bonus (threshold_single and
                 threshold_acc 1: exact), then _commit_accept, as DFlashWorkerV2._accept_block
                 does; max_top_k / uniform_top_k_value passed in as the draft input does.
      settings:  top-k only and top-p only. Not top-k with top-p: upstream renormalises the
                 top-k set before its top-p cut, while SGLang's sampler ("joint") and ours
                 cut top-p on the full distribution, so the targets differ by design.
      compared:  as greedy; a draw within fp32 rounding of a CDF boundary may legitimately
                 differ (each side sums probabilities in its own order).
  draft_attention  batch x block x context, one draft layer (hidden/128 query heads, 8 KV
                   heads of 128, bf16, NHD, page size 1, non-causal), planned before capture.
      ours:      kernels.flashinfer_draft.SplitDraftAttention: the block as a ragged pass
                 over its own K/V, the context as a paged pass, merge_state; nothing written
                 (paged kernel family from DFLASH_DRAFT_PAGED_BACKEND, default auto).
      upstream:  what its FlashInfer backend does per draft layer: write the block's K/V
                 into the cache at the verify slots, then one paged pass over context +
                 block.
      compared:  both against torch attention on request 0, and with each other (bf16:
                 2% of the largest output). Shapes whose KV does not fit in 80% of free
                 memory are skipped and say so.

SGLang, FlashInfer and Triton are imported only once CUDA is known to be there, so --help
and the no-CUDA exit work anywhere. Exit status: 0; 1 if any pair differs, a replay
differs from its eager run or an arm raised (all recorded in the JSON); 2 without CUDA
or without sglang-kernel.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import traceback
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

Outputs = dict[str, torch.Tensor]
KV_HEADS, HEAD_DIM = 8, 128
TARGET_LAYERS = 36  # Qwen3-8B: where the draft's context features come from
TOP_K_OFF = 1 << 30  # SGLang's "no top-k"
SAMPLING = {  # name: (temperature, top_k or None, top_p)
    "t0.8_topk50": (0.8, 50, 1.0),
    "t1.0_topp0.95": (1.0, None, 0.95),
}
ARMS = ("kv_injection", "greedy_accept", "sampled_accept", "draft_attention")


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "artifacts/bench_kernels_gpu.json")
    parser.add_argument("--vocab", type=int, default=151936, help="acceptance vocab (Qwen3)")
    parser.add_argument("--hidden", type=int, default=4096, help="draft hidden size")
    parser.add_argument("--layers", type=int, default=5, help="draft layers")
    parser.add_argument("--batches", type=int_list, default=[1, 8, 32, 48])
    parser.add_argument("--blocks", type=int_list, default=[8, 16])
    parser.add_argument("--contexts", type=int_list, default=[1024, 8192, 32768])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"subset of {','.join(ARMS)}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose from {','.join(ARMS)}")
    return args


# ----------------------------------------------------------------------------- timing


def snapshot(out: Outputs) -> Outputs:
    return {name: t.clone() for name, t in out.items()}


def capture(fn: Callable[[], Outputs]) -> tuple[torch.cuda.CUDAGraph, Outputs]:
    """Warm `fn` up on a side stream (JIT builds, workspaces, caches), then capture one call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def time_graph(fn: Callable[[], Outputs], eager: Outputs) -> dict:
    """Microseconds per replay of `fn`'s graph, and whether a replay reproduces `eager`."""
    import triton.testing

    graph, out = capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    same = all(torch.equal(out[name], eager[name]) for name in eager)
    us = 1e3 * triton.testing.do_bench(graph.replay, return_mode="median")
    return {"us": us, "replay_equals_eager": same}


def run_pair(
    ours: Callable[[], Outputs],
    upstream: Callable[[], Outputs],
    compare: Callable[[Outputs, Outputs], dict],
) -> dict:
    """Compare eager outputs first, then time each side inside its own CUDA graph."""
    eager_ours, eager_upstream = snapshot(ours()), snapshot(upstream())
    row = compare(eager_ours, eager_upstream)
    timed_ours = time_graph(ours, eager_ours)
    timed_upstream = time_graph(upstream, eager_upstream)
    row.update(
        ours_us=timed_ours["us"],
        upstream_us=timed_upstream["us"],
        speedup=timed_upstream["us"] / timed_ours["us"],
        replay_equals_eager=timed_ours["replay_equals_eager"]
        and timed_upstream["replay_equals_eager"],
    )
    return row


# ------------------------------------------------------------------------ acceptance


def acceptance_outputs(result) -> Outputs:
    fields = ("accept_lens", "bonus", "commit_lens", "out_tokens")
    return {name: getattr(result, name) for name in fields}


def compare_acceptance(ours: Outputs, upstream: Outputs) -> dict:
    """Per request: accept length, bonus, commit length and the committed tokens agree.

    Tokens past the commit length are not outputs (upstream leaves drafts there, ours the
    bonus), so they are not compared.
    """
    block = ours["out_tokens"].shape[1]
    cols = torch.arange(block, device=ours["out_tokens"].device)
    committed = cols < ours["commit_lens"].long()[:, None]
    same = ((ours["out_tokens"] == upstream["out_tokens"].long()) | ~committed).all(1)
    for name in ("accept_lens", "bonus", "commit_lens"):
        same = same & (ours[name].long() == upstream[name].long())
    differ = int((~same).sum())
    return {
        "match": differ == 0,
        "requests_differ": differ,
        "mean_accept_len": float(ours["accept_lens"].float().mean()),
    }


def chain_candidates(predict: torch.Tensor, gen: torch.Generator, vocab: int) -> torch.Tensor:
    """Drafts equal to `predict` up to a random length per request, then a mismatch."""
    bs, block = predict.shape
    lens = torch.randint(0, block, (bs, 1), generator=gen, device=predict.device)
    cols = torch.arange(block - 1, device=predict.device)
    drafts = torch.where(cols < lens, predict[:, :-1], (predict[:, :-1] + 1) % vocab)
    anchor = torch.randint(0, vocab, (bs, 1), generator=gen, device=predict.device)
    return torch.cat([anchor, drafts], dim=1).contiguous()


def greedy_case(bs: int, block: int, vocab: int, gen: torch.Generator) -> dict:
    from sglang.kernels.ops.speculative.dflash import (
        _compute_dflash_accept_bonus_triton_unchecked,
    )

    from dflash_sglang.acceptance import Acceptance
    from dflash_sglang.kernels import accept

    device = torch.device("cuda")
    logits = torch.randn(bs * block, vocab, generator=gen, device=device)
    candidates = chain_candidates(logits.argmax(-1).view(bs, block), gen, vocab)
    prefix_lens = torch.randint(1, 4096, (bs,), generator=gen, device=device)
    ours_out = Acceptance(
        accept_lens=torch.empty(bs, dtype=torch.int32, device=device),
        bonus=torch.empty(bs, dtype=torch.int64, device=device),
        commit_lens=torch.empty(bs, dtype=torch.int32, device=device),
        out_tokens=torch.empty(bs, block, dtype=torch.int64, device=device),
    )
    up = {
        "accept_lens": torch.empty(bs, dtype=torch.int32, device=device),
        "commit_lens": torch.empty(bs, dtype=torch.int32, device=device),
        "bonus": torch.empty(bs, dtype=torch.int64, device=device),
        "out_tokens": torch.empty(bs, block, dtype=torch.int64, device=device),
        "new_seq_lens": torch.empty(bs, dtype=torch.int64, device=device),
    }

    def ours() -> Outputs:
        return acceptance_outputs(accept.greedy_accept(logits, candidates, ours_out))

    def upstream() -> Outputs:
        target_predict = torch.argmax(logits, dim=-1).view(bs, block)
        _compute_dflash_accept_bonus_triton_unchecked(
            candidates=candidates,
            target_top1=target_predict,
            accept_lens_out=up["accept_lens"],
            commit_lens_out=up["commit_lens"],
            bonus_ids_out=up["bonus"],
            out_tokens_out=up["out_tokens"],
            prefix_lens=prefix_lens,
            new_seq_lens_out=up["new_seq_lens"],
        )
        return dict(up)

    return run_pair(ours, upstream, compare_acceptance)


def sampled_case(bs: int, block: int, vocab: int, setting: str, gen: torch.Generator) -> dict:
    from sglang.srt.speculative.dflash_utils import (
        compute_dflash_sampling_correct_drafts_and_bonus,
    )
    from sglang.srt.speculative.dflash_worker_v2 import _commit_accept

    from dflash_sglang.kernels import accept

    device = torch.device("cuda")
    temperature, top_k, top_p = SAMPLING[setting]
    logits = 4 * torch.randn(bs * block, vocab, generator=gen, device=device)
    top = logits.argmax(-1).view(bs, block)
    candidates = torch.randint(0, vocab, (bs, block), generator=gen, device=device)
    likely = torch.rand(bs, block - 1, generator=gen, device=device) < 0.8
    candidates[:, 1:] = torch.where(likely, top[:, :-1], candidates[:, 1:])
    coins = torch.rand(bs, block, generator=gen, device=device)  # upstream's shape
    ours_coins = coins[:, :-1].contiguous()  # the last column is never read upstream
    draws = torch.rand(bs, generator=gen, device=device)
    temperatures = torch.full((bs,), temperature, device=device)
    top_ks = torch.full((bs,), top_k or TOP_K_OFF, dtype=torch.int32, device=device)
    top_ps = torch.full((bs,), top_p, device=device)
    sampling_info = SimpleNamespace(
        temperatures=temperatures.view(bs, 1),
        top_ks=top_ks,
        top_ps=top_ps,
        need_top_k_sampling=top_k is not None,
        need_top_p_sampling=top_p < 1.0,
    )

    def ours() -> Outputs:
        result = accept.sampled_accept(
            logits, candidates, temperatures, top_ks, top_ps, None, ours_coins, draws
        )
        return acceptance_outputs(result)

    def upstream() -> Outputs:
        accept_lens, bonus = compute_dflash_sampling_correct_drafts_and_bonus(
            candidates=candidates,
            next_token_logits=logits,
            sampling_info=sampling_info,
            max_top_k=top_k,
            uniform_top_k_value=top_k,
            threshold_single=1.0,
            threshold_acc=1.0,
            uniform_samples=coins,
            uniform_samples_for_final_sampling=draws,
        )
        out_tokens, commit_lens = _commit_accept(candidates, accept_lens, bonus)
        return {
            "accept_lens": accept_lens,
            "bonus": bonus,
            "commit_lens": commit_lens,
            "out_tokens": out_tokens,
        }

    return run_pair(ours, upstream, compare_acceptance)


# ------------------------------------------------------------------------- injection


def bf16_normal(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """N(0, 1) drawn straight into bf16 on the GPU (no float32 copy of a large KV cache)."""
    return torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(generator=gen)


class InjectionBench:
    """One random Qwen3-8B-like draft, our stacked weights and upstream's helper, built once."""

    def __init__(self, hidden: int, layers: int, max_position: int, seed: int) -> None:
        from sglang.kernels.ops.speculative.fused_kv_materialize import (
            FusedKVMaterializeHelper,
        )
        from sglang.srt.runtime_context import use_context
        from sglang.srt.speculative.dflash_utils import build_target_layer_ids
        from transformers import Qwen3Config

        from dflash_sglang.kernels import kv_inject
        from tests.draft_kv import random_draft, runtime

        self.device = torch.device("cuda", torch.cuda.current_device())
        config = Qwen3Config(
            hidden_size=hidden,
            intermediate_size=3 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=hidden // HEAD_DIM,
            num_key_value_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            vocab_size=151936,
            max_position_embeddings=max_position,
            rope_theta=1e6,
        )
        config.num_target_layers = TARGET_LAYERS
        config.dflash_config = {
            "mask_token_id": 151669,
            "target_layer_ids": build_target_layer_ids(TARGET_LAYERS, layers),
        }
        self.runtime = runtime()
        self.model = random_draft(config, torch.bfloat16, self.device, seed)
        self.features = len(config.dflash_config["target_layer_ids"]) * hidden
        self.layers = layers
        first = self.model.layers[0].self_attn
        with use_context(self.runtime), torch.inference_mode():
            self.stacked = kv_inject.stack_kv_weights(self.model)
            self.helper = FusedKVMaterializeHelper(
                layers=self.model.layers,
                rotary_emb=first.rotary_emb,
                num_kv_heads=first.num_kv_heads,
                head_dim=first.head_dim,
                device=self.device,
                # As the worker passes it: no positions.max().item() sync per call.
                max_position_hint=max_position,
            )

    def case(self, bs: int, block: int, max_context: int, gen: torch.Generator) -> dict:
        from sglang.srt.runtime_context import use_context

        from dflash_sglang import kv_injection
        from dflash_sglang.kernels import kv_inject
        from tests.draft_kv import random_pool

        device, rows = self.device, bs * block
        slots = 4 * rows
        pools = [
            random_pool(slots, torch.bfloat16, KV_HEADS, HEAD_DIM, self.layers, device, seed=1)
            for _ in range(2)
        ]
        ok, reason = kv_inject.can_fuse(self.model, pools[0])
        if not ok:
            raise RuntimeError(f"kv_inject.can_fuse refuses this draft and pool: {reason}")
        before = snapshot(pool_buffers(pools[0]))
        hidden = bf16_normal((rows, self.features), gen)
        prefix = torch.randint(0, max_context - block, (bs, 1), generator=gen, device=device)
        positions = (prefix + torch.arange(block, device=device)).view(-1)
        perm = torch.randperm(slots, generator=gen, device=device)
        cache_loc = (perm[:rows] + 1).contiguous()  # slot 0 is padding
        loc_2d = cache_loc.view(bs, block)
        commit_lens = torch.randint(
            1, block + 1, (bs,), generator=gen, device=device, dtype=torch.int32
        )
        written = torch.zeros(slots + 1, dtype=torch.bool, device=device)
        written[cache_loc[kv_injection.committed_rows(commit_lens, block)]] = True

        def ours() -> Outputs:
            kv_inject.inject_committed(
                self.model, self.stacked, pools[0], hidden, positions, cache_loc, commit_lens
            )
            return pool_buffers(pools[0])

        def upstream() -> Outputs:
            pool = pools[1]

            def write_layer_kv(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
                attn = self.model.layers[layer].self_attn.attn
                pool.set_kv_buffer_prefix_valid(
                    attn, loc_2d, commit_lens, k, v, attn.k_scale, attn.v_scale
                )

            ctx_hidden = self.model.project_target_hidden(hidden)
            self.helper.materialize(
                ctx_hidden=ctx_hidden, positions=positions, write_layer_kv=write_layer_kv
            )
            return pool_buffers(pool)

        def compare(got: Outputs, want: Outputs) -> dict:
            return compare_pools(got, want, before, written)

        with use_context(self.runtime), torch.inference_mode():
            row = run_pair(ours, upstream, compare)
        row["mean_commit_len"] = float(commit_lens.float().mean())
        return row


def pool_buffers(pool) -> Outputs:
    buffers = {f"k{i}": b for i, b in enumerate(pool.k_buffer)}
    return buffers | {f"v{i}": b for i, b in enumerate(pool.v_buffer)}


def compare_pools(ours: Outputs, upstream: Outputs, before: Outputs, written) -> dict:
    """Written slots allclose (bf16), every other slot exactly as before on both sides."""
    max_diff, close, untouched = 0.0, True, True
    for name, old in before.items():
        a, b = ours[name], upstream[name]
        untouched &= torch.equal(a[~written], old[~written])
        untouched &= torch.equal(b[~written], old[~written])
        diff = (a[written].float() - b[written].float()).abs()
        max_diff = max(max_diff, float(diff.max()))
        close &= bool((diff <= 1e-2 + 2e-2 * b[written].float().abs()).all())
    return {"match": close and untouched, "untouched_equal": untouched, "max_abs_diff": max_diff}


# ------------------------------------------------------------------------- attention


def attention_case(bs: int, block: int, context: int, heads: int, gen: torch.Generator) -> dict:
    from flashinfer import merge_state

    from dflash_sglang.kernels.draft_attention import draft_layout
    from dflash_sglang.kernels.flashinfer_draft import Heads, SplitDraftAttention, make_wrappers

    device = torch.device("cuda")
    per_request = context + block
    slots = bs * per_request
    kv_bytes = 2 * slots * KV_HEADS * HEAD_DIM * torch.bfloat16.itemsize
    workspace_bytes = 512 << 20  # upstream's FlashInfer workspace for Qwen3 targets
    reference_bytes = 2 * per_request * KV_HEADS * HEAD_DIM * 4 + heads * block * per_request * 8
    need = kv_bytes + 2 * workspace_bytes + reference_bytes
    free, _ = torch.cuda.mem_get_info()
    if need > 0.8 * free:
        return {"skipped": f"needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"}

    # Request i owns slots [i * per_request, (i + 1) * per_request): context, then block.
    kv_shape = (slots, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = bf16_normal(kv_shape, gen), bf16_normal(kv_shape, gen)
    q = bf16_normal((bs * block, heads, HEAD_DIM), gen)
    k_block = bf16_normal((bs * block, KV_HEADS, HEAD_DIM), gen)
    v_block = bf16_normal((bs * block, KV_HEADS, HEAD_DIM), gen)
    req_to_token = torch.arange(slots, dtype=torch.int32, device=device).view(bs, per_request)
    block_slots = req_to_token[:, context:].reshape(-1).long()
    layout = draft_layout(
        req_to_token,
        torch.arange(bs, device=device),
        torch.full((bs,), per_request, dtype=torch.int64),
        block,
    )
    layer = SimpleNamespace(
        tp_q_head_num=heads, tp_k_head_num=KV_HEADS, tp_v_head_num=KV_HEADS,
        head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, scaling=HEAD_DIM**-0.5, logit_cap=0.0,
        k_scale_float=None, v_scale_float=None,
    )  # fmt: skip

    def workspace() -> torch.Tensor:
        return torch.empty(workspace_bytes, dtype=torch.uint8, device=device)

    # Upstream: write the block's K/V into the cache, one paged pass over context + block.
    whole = make_wrappers(workspace(), bs, torch.zeros(slots, dtype=torch.int32, device=device))
    whole.context.plan(
        layout.qo_indptr, torch.arange(bs + 1, dtype=torch.int32) * per_request,
        req_to_token.reshape(-1), torch.ones(bs, dtype=torch.int32), heads, KV_HEADS,
        HEAD_DIM, 1, causal=False, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
    )  # fmt: skip

    def upstream() -> Outputs:
        k_cache[block_slots] = k_block
        v_cache[block_slots] = v_block
        out = whole.context.forward(q, (k_cache, v_cache), causal=False, sm_scale=layer.scaling)
        return {"out": out}

    # Ours: the block ragged over its own K/V, the context paged, merged; no cache write.
    split = SplitDraftAttention(
        Heads(heads, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.bfloat16), merge=merge_state
    )
    indices = torch.zeros(slots, dtype=torch.int32, device=device)
    wrappers = split.plan(make_wrappers(workspace(), bs, indices), layout)

    def ours() -> Outputs:
        flat = (q.view(len(q), -1), k_block.view(len(q), -1), v_block.view(len(q), -1))
        return {"out": split.run(wrappers, *flat, layer, (k_cache, v_cache)).view_as(q)}

    def compare(mine: Outputs, theirs: Outputs) -> dict:
        # Request 0 against plain attention in float32; query head h = k * group + g reads
        # KV head k, as FlashInfer's GQA does.
        q0 = q[:block].float().view(block, KV_HEADS, heads // KV_HEADS, HEAD_DIM)
        k0 = torch.cat([k_cache[:context], k_block[:block]]).float()
        v0 = torch.cat([v_cache[:context], v_block[:block]]).float()
        scores = torch.einsum("qkgd,skd->kgqs", q0, k0) / math.sqrt(HEAD_DIM)
        want = torch.einsum("kgqs,skd->qkgd", scores.softmax(dim=-1), v0).reshape(q[:block].shape)
        scale = float(want.abs().max())
        err_upstream = float((theirs["out"][:block].float() - want).abs().max())
        err_ours = float((mine["out"][:block].float() - want).abs().max())
        diff = float((mine["out"].float() - theirs["out"].float()).abs().max())
        return {
            "match": max(err_ours, err_upstream, diff) <= 2e-2 * scale,
            "max_abs_err_vs_torch": {"ours": err_ours, "upstream": err_upstream},
            "max_abs_diff_ours_vs_upstream": diff,
            "torch_max_abs": scale,
        }

    return run_pair(ours, upstream, compare)


# ------------------------------------------------------------------------------ main


def arm_rows(name: str, args: argparse.Namespace, gen: torch.Generator) -> Iterator[dict]:
    """One row per shape of arm `name`, each labelled with its shape."""
    shapes = [{"bs": bs, "block": block} for bs in args.batches for block in args.blocks]
    if name == "kv_injection":
        max_position = max(args.contexts) + max(args.blocks)
        bench = InjectionBench(args.hidden, args.layers, max_position, args.seed)
        for shape in shapes:
            yield shape | bench.case(shape["bs"], shape["block"], max(args.contexts), gen)
    elif name == "greedy_accept":
        for shape in shapes:
            yield shape | greedy_case(shape["bs"], shape["block"], args.vocab, gen)
    elif name == "sampled_accept":
        for setting in SAMPLING:
            for shape in shapes:
                row = sampled_case(shape["bs"], shape["block"], args.vocab, setting, gen)
                yield {"setting": setting} | shape | row
    else:
        heads = args.hidden // HEAD_DIM
        for context in args.contexts:
            for shape in shapes:
                row = attention_case(shape["bs"], shape["block"], context, heads, gen)
                yield {"context": context} | shape | row
                torch.cuda.empty_cache()  # the next shape's KV cache may need the room


def row_ok(row: dict) -> bool:
    return "skipped" in row or (row["match"] and row["replay_equals_eager"])


def print_table(name: str, result: dict) -> None:
    print(f"\n{name}")
    for row in result["rows"]:
        shape = " ".join(f"{k}={row[k]}" for k in ("setting", "context", "bs", "block") if k in row)
        if "skipped" in row:
            print(f"  {shape:<36} skipped: {row['skipped']}")
            continue
        ours = f"{row['ours_us']:9.1f}" if "ours_us" in row else " " * 9
        speedup = f"{row['speedup']:6.2f}x" if "speedup" in row else " " * 7
        verdict = "ok" if row_ok(row) else "MISMATCH"
        upstream = f"{row['upstream_us']:9.1f}"
        print(f"  {shape:<36} ours {ours} us  upstream {upstream} us  {speedup}  {verdict}")
    if "error" in result:
        print(f"  ERROR: {result['error']}")


def environment() -> dict:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    packages = ("torch", "triton", "sglang", "sglang-kernel", "flashinfer-python")
    return {
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    } | {name: installed_version(name) for name in packages}


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print(
            "bench_kernels_gpu: no CUDA device (torch.cuda.is_available() is False); "
            "run it on a GPU machine after `make gpu-setup`",
            file=sys.stderr,
        )
        return 2
    from dflash_sglang.cpu_platform import real_sgl_kernel_installed

    if not real_sgl_kernel_installed():  # else tests.draft_kv would put the CPU shim in
        print("bench_kernels_gpu: sglang-kernel is not installed; run `make gpu-setup`")
        return 2
    report = {
        "environment": environment(),
        "config": {
            "vocab": args.vocab,
            "hidden": args.hidden,
            "layers": args.layers,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "bfloat16 (injection, attention); float32 logits (acceptance)",
            "batches": args.batches,
            "blocks": args.blocks,
            "contexts": args.contexts,
            "sampling_settings": SAMPLING,
            "timing": "us per CUDA-graph replay, median of triton.testing.do_bench",
            "speedup": "upstream_us / ours_us",
        },
        "arms": {},
    }
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    for name in args.arms:
        result = {"rows": []}
        try:
            for row in arm_rows(name, args, gen):
                result["rows"].append(row)
        except Exception as exc:  # recorded and failing the run; the other arms still run
            result |= {"error": repr(exc), "traceback": traceback.format_exc()}
        result["ok"] = "error" not in result and all(row_ok(r) for r in result["rows"])
        report["arms"][name] = result
        print_table(name, result)
        torch.cuda.empty_cache()
    report["ok"] = all(arm["ok"] for arm in report["arms"].values())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}: {'all pairs match' if report['ok'] else 'FAILURES recorded'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
