"""Triton kernels for the GPU step, each beside a plain-torch twin it is tested against.

Installed as `dflash_sglang.kernels` (a top-level `kernels` would shadow Hugging Face's).
On CPU they run under Triton's interpreter, which must be chosen before anything imports
Triton (`triton.language`'s own reductions are jitted at import): start the process with
TRITON_INTERPRET=1, as the tests' spawned kernel process does.
"""
