"""The worker's CUDA-only Python, driven on CPU: a CUDA platform with torch stand-ins for
its kernels, a worker without SGLang's start-up, and batches made of plain objects."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch

from dflash_sglang import acceptance, platform
from dflash_sglang.draft_vocab import InGraphHead, select
from dflash_sglang.worker import DFlashXWorker, radix_hit_tokens

BS, WIDTH, VOCAB = 3, 4, 11


class KernelCalled(Exception):
    pass


def bare_worker(ours: bool = False, **platform_changes) -> DFlashXWorker:
    """Upstream's kernels unless `ours` (then `dflash_sglang.kernels`, interpreted on CPU)."""
    worker = object.__new__(DFlashXWorker)
    worker.platform = platform.CUDA.with_(**platform_changes)
    worker._ours = ours
    worker._tp_sync = SimpleNamespace(sync=lambda *args: None)
    worker._generator = torch.Generator().manual_seed(0)
    worker._selector_sample = None
    worker._target_logits_processor = None
    return worker


def sampling_info(min_p: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        is_all_greedy=False,
        need_min_p_sampling=min_p is not None,
        temperatures=torch.ones(BS, 1),
        top_ks=torch.full((BS,), VOCAB),
        top_ps=torch.ones(BS),
        min_ps=torch.full((BS,), min_p or 0.0),
    )


def peaked_logits() -> torch.Tensor:
    """Token 3 carries ~70% of the mass at every row, the rest share the remainder."""
    logits = torch.zeros(BS * WIDTH, VOCAB)
    logits[:, 3] = 3.0
    return logits


def test_sampling_kernel_reads_top_k_from_the_draft_input():
    """After prepare_for_verify `batch.spec_info` is the verify input, which has no top-k."""
    seen = {}

    def kernel(**kwargs):
        seen.update(kwargs)
        return torch.zeros(BS, dtype=torch.int32), torch.full((BS,), 3)

    worker = bare_worker(sampling_verify=kernel)
    batch = SimpleNamespace(sampling_info=sampling_info(), spec_info=SimpleNamespace())
    draft_input = SimpleNamespace(max_top_k=VOCAB, uniform_top_k_value=None)
    candidates = torch.ones(BS, WIDTH, dtype=torch.int64)
    accepted = worker.accept(candidates, peaked_logits(), batch, draft_input)
    assert seen["max_top_k"] == VOCAB and seen["uniform_top_k_value"] is None
    assert accepted.bonus.tolist() == [3] * BS


def test_min_p_takes_the_exact_path_on_cuda():
    """Upstream's fused kernel applies top-k/top-p only; min-p must still be exact."""

    def kernel(**kwargs):
        raise KernelCalled

    worker = bare_worker(sampling_verify=kernel)
    batch = SimpleNamespace(sampling_info=sampling_info(min_p=0.5), spec_info=None)
    draft_input = SimpleNamespace(max_top_k=VOCAB, uniform_top_k_value=None)
    candidates = torch.ones(BS, WIDTH, dtype=torch.int64)  # drafts of token 1: always rejected
    for _ in range(20):  # min-p 0.5 leaves token 3 alone: every bonus is 3
        accepted = worker.accept(candidates, peaked_logits(), batch, draft_input)
        assert accepted.accept_lens.tolist() == [0] * BS
        assert accepted.bonus.tolist() == [3] * BS
    without_min_p = SimpleNamespace(sampling_info=sampling_info(), spec_info=None)
    with pytest.raises(KernelCalled):
        worker.accept(candidates, peaked_logits(), without_min_p, draft_input)


def test_decode_step_adopts_seq_lens_before_using_them():
    """Overlap scheduling hands `seq_lens` over from another stream: record it first."""
    adopted = []
    worker = bare_worker(adopt_tensor=adopted.append)

    def stop(*args):
        raise KernelCalled

    worker._host_prefix_lens = stop
    seq_lens = torch.tensor([5, 7])
    with pytest.raises(KernelCalled):
        worker.decode_step(SimpleNamespace(spec_info=None, seq_lens=seq_lens), None, None)
    assert adopted == [seq_lens]


def test_cuda_platform_records_on_the_current_stream():
    streams = []

    class Carried(torch.Tensor):
        def record_stream(self, stream):
            streams.append(stream)

    platform.CUDA.adopt_tensor(torch.zeros(2).as_subclass(Carried))
    assert streams == [torch.cpu.current_stream()]
    assert platform.CPU.adopt_tensor(torch.zeros(2)) is None


class ShardedLogits:
    """A TP logits processor stand-in: the full gather must not happen on greedy batches."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits, self.gathered = logits, False

    def is_deferred_shard(self, logits) -> bool:
        return logits is self.logits

    def deferred_argmax(self, logits) -> torch.Tensor:
        return logits.argmax(-1)

    def finish_deferred_gather(self, logits) -> torch.Tensor:
        self.gathered = True
        return logits


def test_tp_greedy_verify_skips_the_full_logits_gather():
    logits = peaked_logits()
    worker = bare_worker()
    worker._target_logits_processor = lp = ShardedLogits(logits)
    batch = SimpleNamespace(has_grammar=False, return_logprob=False, sampling_info=None)
    out = SimpleNamespace(next_token_logits=logits)
    predict = worker._finish_verify_logits(batch, out, WIDTH)
    assert not lp.gathered and out.next_token_logits is None
    candidates = torch.full((BS, WIDTH), 3, dtype=torch.int64)
    accepted = worker.accept(candidates, None, batch, None, predict)
    assert accepted.accept_lens.tolist() == [WIDTH - 1] * BS

    logprobs = SimpleNamespace(has_grammar=False, return_logprob=True, sampling_info=None)
    out = SimpleNamespace(next_token_logits=logits)
    assert worker._finish_verify_logits(logprobs, out, WIDTH) is None
    assert lp.gathered and out.next_token_logits is logits


class Req:
    def __init__(self, cached_tokens: int = 0) -> None:
        self.cached_tokens = cached_tokens


def test_radix_hits_count_cache_hits_only():
    counted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    hit, chunked, running = Req(32), Req(0), Req(10)
    assert radix_hit_tokens([running], counted) == 10  # its own prefill
    # First chunks: a 32-token radix hit and a cold prompt.
    assert radix_hit_tokens([hit, chunked], counted) == 32
    # Later chunks (prefix = earlier chunks) in a mixed batch with a running request.
    assert radix_hit_tokens([hit, chunked, running], counted) == 0


def test_restricted_head_in_graph_equals_the_eager_head():
    torch.manual_seed(0)
    hidden, head = torch.randn(BS * WIDTH, 8), torch.randn(50, 8)
    ids = torch.tensor([1, 4, 9, 20, 33, 49])
    sampler = InGraphHead(head[ids], ids, WIDTH, max_bs=8)
    sampler(hidden)
    blocks = hidden.view(BS, WIDTH, -1)[:, 1:, :]
    expected = select(blocks, head[ids], ids).reshape(-1)
    assert torch.equal(sampler.out[: BS * (WIDTH - 1)], expected)
    assert sampler.out.numel() == 8 * (WIDTH - 1)


def test_greedy_accept_path_unchanged_without_predict():
    worker = bare_worker()
    logits = peaked_logits()
    candidates = torch.full((BS, WIDTH), 3, dtype=torch.int64)
    batch = SimpleNamespace(sampling_info=None)
    got = worker.accept(candidates, logits, batch, None)
    want = acceptance.greedy_accept(candidates, logits.argmax(-1).view(BS, WIDTH))
    assert torch.equal(got.out_tokens, want.out_tokens)


def check_our_kernels_decide_acceptance() -> None:
    worker = bare_worker(ours=True)
    torch.manual_seed(1)
    logits = torch.randn(BS * WIDTH, VOCAB)
    candidates = torch.randint(0, VOCAB, (BS, WIDTH))
    candidates[:, 1:] = logits.argmax(-1).view(BS, WIDTH)[:, :-1]  # all accepted...
    candidates[0, 2] = (candidates[0, 2] + 1) % VOCAB  # ...but one draft of request 0
    greedy = worker.accept(candidates, logits, SimpleNamespace(sampling_info=None), None)
    want = acceptance.greedy_accept(candidates, logits.argmax(-1).view(BS, WIDTH))
    assert torch.equal(greedy.out_tokens, want.out_tokens)
    assert greedy.accept_lens.tolist() == [1, WIDTH - 1, WIDTH - 1]
    # min-p 0.5 leaves token 3 alone: drafts of token 1 are rejected, every bonus is 3.
    batch = SimpleNamespace(sampling_info=sampling_info(min_p=0.5))
    ones = torch.ones(BS, WIDTH, dtype=torch.int64)
    sampled = worker.accept(ones, peaked_logits(), batch, None)
    assert sampled.accept_lens.tolist() == [0] * BS and sampled.bonus.tolist() == [3] * BS


def test_our_kernels_decide_acceptance(interpret):
    interpret(check_our_kernels_decide_acceptance)


class _DeviceTimer:
    """A CUDA timer stand-in: `seconds` is None until the device has run the region."""

    def __init__(self, seconds: float | None) -> None:
        self._seconds = seconds

    def seconds(self) -> float | None:
        return self._seconds


@pytest.mark.parametrize("draft_seconds", [None, 0.02])
def test_step_cost_takes_the_device_timed_draft_forward_or_skips_the_step(draft_seconds):
    """The planner prices the drafter from its own (device) timer, read a step later without
    synchronising; a timer the GPU has not reached yet skips that step's measurement."""
    worker = bare_worker()
    observed = []
    worker.planner = SimpleNamespace(observe_seconds=lambda *a: observed.append(a))
    worker.metrics = None
    plan = SimpleNamespace(predicted_seconds=0.1)
    worker._last_step = (plan, 2, 0.0, _DeviceTimer(draft_seconds))
    now = worker._observe_step_start()
    if draft_seconds is None:
        assert observed == []
    else:
        assert observed == [(plan, 2, now, draft_seconds)]
