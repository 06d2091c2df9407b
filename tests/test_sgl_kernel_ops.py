import torch

from dflash_sglang.cpu_platform import sgl_kernel_ops as ops


def _segments():
    req = torch.tensor([2, 0, 3])
    start = torch.tensor([1, 0, 4])
    end = torch.tensor([4, 2, 5])
    return req, start, end


def test_assign_req_to_token_pool_matches_loop():
    req, start, end = _segments()
    table = torch.zeros(4, 8, dtype=torch.int32)
    locs = torch.arange(100, 106)
    ops.assign_req_to_token_pool_cpu(req, table, start, end, locs, 8)
    expected = torch.zeros(4, 8, dtype=torch.int32)
    pos = 0
    for r, s, e in zip(req.tolist(), start.tolist(), end.tolist(), strict=True):
        expected[r, s:e] = locs[pos : pos + e - s].int()
        pos += e - s
    assert torch.equal(table, expected)


def _loop_index(req, start, end, row_len):
    return [r * row_len + c for r, s, e in zip(req, start, end, strict=True) for c in range(s, e)]


def test_segment_index_equal_lengths_match_the_general_path():
    # Equal lengths take the broadcast; the ragged case (and empty segments) the general path.
    req, start = torch.tensor([2, 0, 3]), torch.tensor([1, 0, 4])
    for width in (0, 1, 3):
        end = start + width
        got = ops.segment_index(req, start, end, 8)
        assert got.tolist() == _loop_index(req.tolist(), start.tolist(), end.tolist(), 8)
    ragged = ops.segment_index(*_segments(), 8)
    assert ragged.tolist() == _loop_index(*(t.tolist() for t in _segments()), 8)


def test_assign_extend_cache_locs_is_inverse():
    req, start, end = _segments()
    table = torch.arange(32, dtype=torch.int32).view(4, 8)
    out = torch.full((6,), -1, dtype=torch.int64)
    ops.assign_extend_cache_locs_cpu(req, table, start, end, out, 8)
    assert out.tolist() == [17, 18, 19, 0, 1, 28]


def test_draft_cache_locs_contiguous():
    table = torch.arange(32, dtype=torch.int32).view(4, 8)
    out = torch.empty(4, dtype=torch.int64)
    ops.assign_draft_cache_locs_contiguous_cpu(
        torch.tensor([1, 3]), table, torch.tensor([2, 5]), out, 8, 1, 2
    )
    assert out.tolist() == [10, 11, 29, 30]


def test_copy_all_layer_kv_cache_moves_rows_in_every_layer():
    layers = [torch.arange(40, dtype=torch.float32).view(10, 4).clone() for _ in range(2)]
    before = [t.clone() for t in layers]
    ptrs = torch.tensor([t.data_ptr() for t in layers])
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers])
    # overlapping move: rows 2,3 -> 3,4 must read sources before writing
    ops.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([3, 4]), torch.tensor([2, 3]))
    for t, b in zip(layers, before, strict=True):
        assert torch.equal(t[3], b[2]) and torch.equal(t[4], b[3])
        assert torch.equal(t[:3], b[:3]) and torch.equal(t[5:], b[5:])
