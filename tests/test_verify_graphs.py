"""Per-width verify graphs (`verify_graphs`), driven on CPU with stand-ins for SGLang's
attention backends and graph runners: what is captured, what is active when, and that the
worker's verify runs inside its width's state and leaves the block's behind."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash_sglang import platform
from dflash_sglang import worker as worker_module
from dflash_sglang.suffix import SuffixProposal
from dflash_sglang.tree import build_tree, custom_mask
from dflash_sglang.verify_graphs import VerifyGraphs, VerifyState
from dflash_sglang.worker import BlockSlots
from tests.test_worker_cuda_branch import bare_worker

BLOCK = 8


def runner() -> SimpleNamespace:
    return SimpleNamespace(attn_backend="backend8", decode_cuda_graph_runner="graph8")


def capture(model_runner, width: int) -> VerifyState:
    return VerifyState(f"backend{width}", f"graph{width}")


def test_nothing_to_swap_without_graphs_or_other_widths():
    no_graphs = SimpleNamespace(attn_backend="b", decode_cuda_graph_runner=None)
    assert VerifyGraphs.build(no_graphs, (1, 2, BLOCK), BLOCK, capture) is None
    assert VerifyGraphs.build(runner(), (BLOCK,), BLOCK, capture) is None  # fixed width
    assert platform.CPU.verify_graphs(runner(), (1, BLOCK), BLOCK) is None


def test_every_other_width_is_captured_and_swapped_as_a_unit():
    model_runner = runner()
    captured = []
    graphs = VerifyGraphs.build(
        model_runner, (1, 2, 4, BLOCK), BLOCK, lambda r, w: captured.append(w) or capture(r, w)
    )
    assert captured == [1, 2, 4]
    assert (model_runner.attn_backend, model_runner.decode_cuda_graph_runner) == (
        "backend8",
        "graph8",
    )
    graphs.activate(2)
    assert (model_runner.attn_backend, model_runner.decode_cuda_graph_runner) == (
        "backend2",
        "graph2",
    )
    with graphs.using(4):
        assert model_runner.decode_cuda_graph_runner == "graph4"
    assert model_runner.decode_cuda_graph_runner == "graph8"  # the block's, after a verify
    graphs.activate(3)  # no graph of its own: the block's backend, eager
    assert (model_runner.attn_backend, model_runner.decode_cuda_graph_runner) == (
        "backend8",
        "graph8",
    )


def recording_worker(monkeypatch, input_class: str, widths: tuple[int, ...]):
    """A CUDA worker whose verify input (`input_class` in the worker module) and target
    forward record the attention backend, custom mask and graph runner they see."""
    model_runner = runner()
    seen = []

    class VerifyInput:
        def __init__(self, **fields):
            self.fields = fields

        def prepare_for_verify(self, view, target_worker):
            seen.append(("prepare", model_runner.attn_backend, self.fields["custom_mask"]))
            return SimpleNamespace(), None

    def forward(**_):
        seen.append(("forward", model_runner.decode_cuda_graph_runner))
        logits = SimpleNamespace(next_token_logits=torch.zeros(1, 5))
        return SimpleNamespace(logits_output=logits, can_run_cuda_graph=True)

    monkeypatch.setattr(worker_module, input_class, VerifyInput)
    worker = bare_worker()
    worker._target_worker = SimpleNamespace(
        model_runner=model_runner, forward_batch_generation=forward
    )
    worker._verify_graphs = VerifyGraphs.build(model_runner, widths, BLOCK, capture)
    return worker, model_runner, seen


@pytest.mark.parametrize("width", [1, 2, BLOCK])
def test_the_verify_forward_runs_in_its_widths_graph(monkeypatch, width):
    worker, model_runner, seen = recording_worker(monkeypatch, "DFlashVerifyInput", (1, 2, BLOCK))
    batch = SimpleNamespace(has_grammar=False, sampling_info=None)
    slots = BlockSlots(torch.zeros(2 * width), torch.zeros(2 * width), None, width)
    candidates = torch.zeros(2, width, dtype=torch.int64)
    worker.verify(batch, candidates, slots, torch.tensor([5 + width, 9 + width]))
    assert seen == [("prepare", f"backend{width}", None), ("forward", f"graph{width}")]
    assert model_runner.decode_cuda_graph_runner == "graph8"


def test_a_tree_verify_on_cuda_runs_eager_with_the_trees_custom_mask(monkeypatch):
    """FlashInfer takes a tree only as a custom mask planned on an eager wrapper: the verify
    graphs were captured for chains. The tree step's verify sees no graph runner and carries
    `tree.custom_mask` over the committed prefixes; the block's graph is back afterwards."""
    worker, model_runner, seen = recording_worker(monkeypatch, "TreeVerifyInput", (1, 5, BLOCK))
    drafts = torch.tensor([[1, 10, 11, 12, 13]] * 2)
    rows = build_tree(drafts, [SuffixProposal((20, 21), 2, 1), None], width=5, dflash_len=2)
    batch = SimpleNamespace(has_grammar=False, sampling_info=None)
    slots = BlockSlots(torch.zeros(10), torch.zeros(10), None, 5)
    prefix = torch.tensor([6, 9])
    worker.verify(batch, rows.tokens, slots, prefix + 5, rows=rows)
    (_, backend, mask), forward_seen = seen
    assert backend == "backend8" and forward_seen == ("forward", None)
    assert torch.equal(mask, custom_mask(rows, prefix))
    assert model_runner.decode_cuda_graph_runner == "graph8"


def test_trees_need_a_target_backend_that_takes_their_mask():
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    flashinfer = SimpleNamespace(attn_backend=object.__new__(FlashInferAttnBackend))
    assert platform.CUDA.tree_verify(flashinfer)
    assert not platform.CUDA.tree_verify(SimpleNamespace(attn_backend="triton"))
    assert platform.CPU.tree_verify(SimpleNamespace(attn_backend="dflash_cpu"))
    worker = bare_worker()
    worker.options = SimpleNamespace(tree="on")
    assert worker._trees_run(SimpleNamespace(model_runner=flashinfer))
    assert not worker._trees_run(SimpleNamespace(model_runner=runner()))
