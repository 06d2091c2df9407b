"""The first-GPU smoke test (`make gpu-check`): the embedded SmolLM2 and its bundled drafter
served under DFLASH_X on CUDA — FlashInfer attention, CUDA graphs, upstream's fused KV
injection and sampling kernels — greedy in float32, token for token equal to plain decoding
on the same device. Skipped where there is no CUDA device."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dflash_sglang.drafters import default_draft_dir
from tests.prompts import LONG, SHORT
from tests.server import ar_and_dflash

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PROMPTS = ["What is the capital of France?", "Write a Python function that adds two numbers."]


@pytest.fixture(scope="module")
def cuda_servers(converted, tmp_path_factory):
    target, _ = converted
    common = ["--model-path", str(target), "--device", "cuda", "--dtype", "float32"]
    common += ["--max-total-tokens", "16384", "--mem-fraction-static", "0.3"]
    with ar_and_dflash(common, default_draft_dir(), tmp_path_factory.mktemp("gpu")) as pair:
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


def test_sampling_runs_on_cuda(cuda_servers):
    """The fused sampling verify (and min-p's exact path) on the device."""
    _, dx = cuda_servers
    for params in ({"temperature": 1.0, "top_p": 0.9}, {"temperature": 0.8, "min_p": 0.1}):
        out = dx.generate(PROMPTS[0], max_new_tokens=32, **params)
        assert out["meta_info"]["completion_tokens"] > 0
