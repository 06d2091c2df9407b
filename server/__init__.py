"""Our additions to SGLang's FastAPI app (installed as `dflash_sglang.server`)."""

from fastapi import FastAPI


def install(app: FastAPI) -> None:
    """`/dflash/stats`, `/dflash/stats/series`, the `/dflash/` status page, request checks."""
    from dflash_sglang.server import stats, status_page, validation

    stats.install(app)
    status_page.install(app)
    validation.install(app)
