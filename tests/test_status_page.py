"""The `/dflash/` status page rendered by real headless Chromium against a live server."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import requests

from tests.browser import dump_dom, screenshot
from tests.prompts import SHORT

pytestmark = pytest.mark.server
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"


def _text(dom: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
    assert match, f"#{element_id} missing from the rendered page"
    return match.group(1)


def test_status_page_renders_live_stats(live_dflash, tmp_path):
    for prompt in SHORT[:3]:
        live_dflash.generate(prompt, max_new_tokens=48, ignore_eos=True)
    assert requests.get(live_dflash.url + "/dflash", timeout=30).url.endswith("/dflash/")
    stats = requests.get(live_dflash.url + "/dflash/stats?window_steps=200", timeout=30).json()

    dom = dump_dom(live_dflash.url + "/dflash/")
    assert 'data-ready="1"' in dom, "the page's script never rendered the stats"
    assert _text(dom, "tau") == f"{stats['window']['tau']:.2f}"
    assert _text(dom, "tau-start") == f"{stats['since_start']['tau']:.2f}"
    # The live server verifies the whole block (8) every step, DFlash only.
    assert _text(dom, "verify-width") == "8.0" and _text(dom, "width-last") == "8"
    assert _text(dom, "spec-off") == "0.0%"
    # DFlash block / own-text lookup / shared lookup: the last two never proposed here.
    assert _text(dom, "tau-sources") == f"{stats['window']['tau']:.2f} / – / – / –"
    expected = stats["window"]["predicted_tau_by_source"]["dflash"]
    assert 1.0 < expected and _text(dom, "tau-expected") == f"{expected:.2f} / – / – / –"
    times = stats["window"]["step_time_by_option"]
    assert list(times) == ["w8+draft"]
    assert _text(dom, "step-times").startswith("w8+draft ")
    positions = len(stats["since_start"]["acceptance_by_position"])
    assert positions == 7
    assert dom.count('class="bar window"') == positions
    assert dom.count('class="bar start"') == positions
    assert _text(dom, "error") == ""

    shot = screenshot(live_dflash.url + "/dflash/", tmp_path / "status_page.png")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a drawn page, not blank
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "status_page.png")


def test_series_reports_throughput_over_time(live_dflash):
    live_dflash.generate(SHORT[4], max_new_tokens=64, ignore_eos=True)
    body = requests.get(
        live_dflash.url + "/dflash/stats/series?seconds=600&step_s=1", timeout=30
    ).json()
    points = body["points"]
    assert body["step_s"] == 1 and len(points) >= 2
    assert any(p["output_tokens_per_s"] > 0 for p in points)
    assert all(p["tau"] is None or p["tau"] >= 1 for p in points)
    widths = [p["mean_verify_width"] for p in points if p["mean_verify_width"] is not None]
    # A scrape can fall between one step's histogram sum and bucket writes: within a step.
    assert widths and all(w == pytest.approx(8, abs=0.5) for w in widths)
    assert all(p["speculation_off_share"] in (None, 0) for p in points)
    bad = requests.get(live_dflash.url + "/dflash/stats/series?step_s=0", timeout=30)
    assert 400 <= bad.status_code < 500 and "step_s" in bad.text
