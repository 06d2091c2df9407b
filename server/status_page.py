"""`GET /dflash/`: a live status page drawn in the browser from `/dflash/stats`.

One static file with inline JS and SVG: no CDN, so it works on closed networks.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, RedirectResponse


def page() -> str:
    return files("dflash_sglang.server").joinpath("static/status.html").read_text()


def install(app: FastAPI) -> None:
    html = page()

    @app.get("/dflash/", response_class=HTMLResponse, include_in_schema=False)
    def status() -> str:
        return html

    @app.get("/dflash", include_in_schema=False)
    def status_redirect() -> RedirectResponse:
        return RedirectResponse("/dflash/")
