"""Stand-in for the CPU build of sgl-kernel, put on the import path by dflash_sglang's launcher.

Only used on CPU when no real `sgl_kernel` is installed. Ops we implement come from
`dflash_sglang.cpu_platform.sgl_kernel_ops`; any other op imports (SGLang imports many at module
level) but raises a clear error if it is ever called.
"""

from dflash_sglang.cpu_platform.sgl_kernel_ops import (  # noqa: F401
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    copy_all_layer_kv_cache_cpu,
)

__version__ = "0.0.0+dflash_sglang.cpu_shim"
IS_DFLASH_SGLANG_SHIM = True


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _unavailable(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: this CPU machine has no sgl-kernel build and "
            "dflash_sglang's CPU platform layer does not implement this op."
        )

    _unavailable.__name__ = name
    return _unavailable
