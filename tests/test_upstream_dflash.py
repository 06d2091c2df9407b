"""SGLang's own DFLASH worker on CPU through our platform layer (`cpu_platform.upstream_dflash`).

The server test runs `--speculative-algorithm DFLASH` on the tiny half-accepting pair in
float32 and holds it to plain decoding's tokens (`live_ar`), as the DFLASH_X tests do.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dflash_sglang.cpu_platform import upstream_dflash
from dflash_sglang.platform import CPU_ATTENTION_BACKEND
from tests.prompts import SHARED_PREFIX, SHORT
from tests.server import Server

MAX_NEW = 24


class _Platform:
    device_name = "cpu"

    def is_out_of_tree(self) -> bool:
        return False

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return False


def test_platform_view_claims_dflash_with_our_backend_only():
    view = upstream_dflash.DFlashOnCPUPlatform(_Platform())
    assert view.is_out_of_tree()
    assert view.supports_speculative_algorithm("DFLASH")
    assert not view.supports_speculative_algorithm("EAGLE")
    assert view.supports_speculative_draft_attention_backend("DFLASH", CPU_ATTENTION_BACKEND)
    assert not view.supports_speculative_draft_attention_backend("DFLASH", "flashinfer")
    assert view.get_default_speculative_draft_attention_backend("DFLASH") == CPU_ATTENTION_BACKEND
    assert view.device_name == "cpu"  # everything else is the real platform's


class _Args:
    def __init__(self, device: str) -> None:
        self.device = device


def test_argument_checks_see_the_view_on_cpu_only():
    from sglang.srt.arg_groups import speculative_hook

    seen = []

    def original(args):
        seen.append(type(speculative_hook.current_platform))
        raise ValueError("rejected")  # the real platform must come back even so

    real = speculative_hook.current_platform
    with pytest.raises(ValueError):
        upstream_dflash.handle_dflash_on_cpu(original, _Args("cpu"))
    upstream_dflash.handle_dflash_on_cpu(lambda args: seen.append(None), _Args("cuda"))
    assert seen == [upstream_dflash.DFlashOnCPUPlatform, None]
    assert speculative_hook.current_platform is real


def test_worker_class_prepares_the_draft_as_dflash_x_does():
    class Attention(torch.nn.Module):
        use_table_qk_norm_rope = True

    class Draft(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)  # float32: the model's dtype
            self.attn = torch.nn.ModuleList([Attention(), Attention()])

        def forward(self, input_embeds=None):
            return input_embeds.dtype

    class Worker:
        def __init__(self, draft: torch.nn.Module) -> None:
            self.draft_model = draft
            self.draft_parallel_layout = None  # resolved by upstream's worker

    draft = Draft()
    worker = upstream_dflash.cpu_worker_class(Worker)(draft)
    assert isinstance(worker, Worker)
    assert [m.use_table_qk_norm_rope for m in draft.attn] == [False, False]  # off Triton
    assert draft.forward(input_embeds=torch.zeros(1, dtype=torch.bfloat16)) == torch.float32


@pytest.fixture(scope="module")
def upstream(half_models, tmp_path_factory):
    args = [
        *("--model-path", str(half_models["target"]), "--dtype", "float32"),
        *("--max-total-tokens", "8192", "--speculative-algorithm", "DFLASH"),
        *("--speculative-draft-model-path", str(half_models["draft"])),
    ]
    server = Server(args, tmp_path_factory.mktemp("upstream_logs") / "upstream.log")
    yield server
    server.stop()


def _ids(server: Server, text: str) -> list[int]:
    return server.generate(text, max_new_tokens=MAX_NEW, ignore_eos=True)["output_ids"]


@pytest.mark.server
def test_upstream_dflash_speculates_and_is_lossless(upstream, live_ar):
    metas = []
    for text in SHORT[:4]:
        out = upstream.generate(text, max_new_tokens=MAX_NEW, ignore_eos=True)
        assert out["output_ids"] == _ids(live_ar, text), text
        metas.append(out["meta_info"])
    assert all(m["spec_verify_ct"] >= 1 for m in metas)
    assert max(m["spec_accept_length"] for m in metas) > 1.0  # the pair accepts part-blocks
    assert "Initialized DFLASH draft runner" in upstream.log_path.read_text()


@pytest.mark.server
def test_upstream_dflash_concurrent_is_lossless(upstream, live_ar):
    texts = [SHARED_PREFIX + " " + t for t in SHORT[:6]]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda t: _ids(upstream, t), texts))
    assert got == [_ids(live_ar, t) for t in texts]
