"""dflash-sglang: DFlash block-diffusion speculative decoding served on SGLang (`DFLASH_X`)."""

ALGORITHM = "DFLASH_X"

__all__ = ["ALGORITHM"]
