"""The first-GPU smoke test (`make gpu-check`): the embedded SmolLM2 and its bundled drafter
served under DFLASH_X on CUDA — FlashInfer attention, CUDA graphs, upstream's fused KV
injection and sampling kernels — greedy in float32, token for token equal to plain decoding
on the same device. Skipped where there is no CUDA device."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dflash_sglang.drafters import default_draft_dir
from dflash_sglang.loadtest import server_metrics
from tests.prompts import LONG, SHORT
from tests.server import PURE_DFLASH, Server, ar_and_dflash

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PROMPTS = ["What is the capital of France?", "Write a Python function that adds two numbers."]


def _common(converted) -> list[str]:
    target, _ = converted
    common = ["--model-path", str(target), "--device", "cuda", "--dtype", "float32"]
    return [*common, "--max-total-tokens", "16384", "--mem-fraction-static", "0.3"]


@pytest.fixture(scope="module")
def cuda_servers(converted, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("gpu")
    with ar_and_dflash(_common(converted), default_draft_dir(), log_dir) as pair:
        yield pair


def test_greedy_fp32_equals_plain_decoding_on_cuda(cuda_servers):
    ar, dx = cuda_servers
    prompts = PROMPTS + SHORT[:6] + [LONG]

    def both(text):
        kwargs = {"max_new_tokens": 64, "ignore_eos": True}
        return ar.generate(text, **kwargs)["output_ids"], dx.generate(text, **kwargs)

    with ThreadPoolExecutor(8) as pool:  # concurrent: batches > 1 through the CUDA graphs
        results = list(pool.map(both, prompts))
    for plain, spec in results:
        assert spec["output_ids"] == plain
    assert sum(spec["meta_info"]["spec_verify_ct"] for _, spec in results) > 0


def test_split_draft_attention_is_lossless_on_cuda(cuda_servers, converted, tmp_path):
    """`dflash_flashinfer` (block ragged, context paged, merged; no block K/V written):
    greedy output equal to plain decoding, and drafts still accepted (attention gone wrong
    leaves a drafter accepting nothing, lossless all the same)."""
    ar, _ = cuda_servers
    args = [*_common(converted), "--speculative-draft-model-path", str(default_draft_dir())]
    args += [*PURE_DFLASH, "--speculative-draft-attention-backend", "dflash_flashinfer"]
    split = Server(args, tmp_path / "split.log")
    try:
        kwargs = {"max_new_tokens": 64, "ignore_eos": True}
        with ThreadPoolExecutor(8) as pool:
            plain = list(pool.map(lambda p: ar.generate(p, **kwargs), PROMPTS + SHORT[:6]))
            ours = list(pool.map(lambda p: split.generate(p, **kwargs), PROMPTS + SHORT[:6]))
    finally:
        split.stop()
    assert [o["output_ids"] for o in ours] == [p["output_ids"] for p in plain]
    steps = sum(o["meta_info"]["spec_verify_ct"] for o in ours)
    tokens = sum(o["meta_info"]["completion_tokens"] for o in ours)
    assert steps < 0.9 * tokens, (steps, tokens)


def test_sampling_runs_on_cuda(cuda_servers):
    """The fused sampling verify (and min-p's exact path) on the device."""
    _, dx = cuda_servers
    for params in ({"temperature": 1.0, "top_p": 0.9}, {"temperature": 0.8, "min_p": 0.1}):
        out = dx.generate(PROMPTS[0], max_new_tokens=32, **params)
        assert out["meta_info"]["completion_tokens"] > 0


def test_two_branch_trees_are_lossless_on_cuda(cuda_servers, converted, tmp_path):
    """Trees on the device: FlashInfer's custom-mask verify (eager), the tree's KV slots
    reordered, greedy fp32 output equal to plain decoding, and trees really verified."""
    ar, _ = cuda_servers
    args = [*_common(converted), "--speculative-draft-model-path", str(default_draft_dir())]
    tree = Server([*args, "--dflash-tree", "always", "--dflash-widths", "1,4"], tmp_path / "t.log")
    texts = [" ".join([p] * 4) for p in SHORT[:4]] + PROMPTS
    try:
        before = server_metrics.scrape(tree.url)
        kwargs = {"max_new_tokens": 64, "ignore_eos": True}
        with ThreadPoolExecutor(8) as pool:
            plain = list(pool.map(lambda p: ar.generate(p, **kwargs), texts))
            ours = list(pool.map(lambda p: tree.generate(p, **kwargs), texts))
        deltas = server_metrics.counter_deltas(before, server_metrics.scrape(tree.url))
    finally:
        tree.stop()
    assert [o["output_ids"] for o in ours] == [p["output_ids"] for p in plain]
    key = server_metrics.sample_key("dflash_num_drafts_total", {"source": "tree"})
    assert deltas.get(key, 0) > 0, "no tree was verified"
