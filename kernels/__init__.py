"""Triton kernels for the GPU step and one C++ kernel for the CPU step (`cpu_attention`),
each beside a plain-torch twin it is tested against.

Installed as `dflash_sglang.kernels` (a top-level `kernels` would shadow Hugging Face's).
On CPU the Triton kernels run under Triton's interpreter, which must be chosen before
anything imports Triton (`triton.language`'s own reductions are jitted at import): start
the process with TRITON_INTERPRET=1, as the tests' spawned kernel process does.
"""
