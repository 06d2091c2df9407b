"""Our additions to SGLang's FastAPI app (installed as `dflash_sglang.server`)."""
