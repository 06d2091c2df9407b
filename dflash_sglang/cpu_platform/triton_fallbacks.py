"""Keep Triton kernels off the CPU serving path.

Without a GPU, Triton kernels only run under its interpreter, which is slow enough to
dominate a CPU step. SGLang modules that pick a Triton path by feature flag get the flag
cleared here, so they take their own torch path.
"""

from __future__ import annotations

import torch


def use_torch_paths(draft_model: torch.nn.Module) -> None:
    """DFlash draft attention: plain q/k norm + RoPE instead of `table_qk_norm_rope_`."""
    for module in draft_model.modules():
        if hasattr(module, "use_table_qk_norm_rope"):
            module.use_table_qk_norm_rope = False
