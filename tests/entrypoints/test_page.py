"""The page at ``/`` in a real headless Chromium (Debian's package, driven by Playwright): the
threads decode in their own columns as events arrive, then the spliced answer shows the
promises highlighted and the step counter is below what sequential decoding takes."""

from __future__ import annotations

import os
import shutil

import pytest
from playwright import sync_api

ANNOTATED = ('Two tips: <promise topic="sleep" tokens="10"/><async>Sleep early, every day.</async> and '
             '<promise topic="walk" tokens="10"/><async>Walk after lunch.</async><sync/> That is all.')


def chromium() -> str:
    """Path of a Chromium executable, or skip the test saying how to get one."""
    exe = os.environ.get("PASTA_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not exe:
        pytest.skip("no Chromium browser found: install Debian's package (apt-get install chromium) or set "
                    "PASTA_CHROMIUM=/path/to/chrome; the page test needs a real browser")
    return exe


def replay_on_page(page, server, annotated: str, prompt: str) -> None:
    """Open the page, replay ``annotated`` for ``prompt`` through its form and wait for the end
    (asserting it ended done, not in an error)."""
    page.goto(server.url + "/")
    page.click("summary")
    page.fill("#api-key", server.api_key)
    page.fill("#annotated", annotated)
    page.fill("#prompt", prompt)
    page.click("#run")
    page.wait_for_selector("body[data-state=done], body[data-state=error]", timeout=120_000)
    assert page.get_attribute("body", "data-state") == "done", page.inner_text("#error")


def test_page_shows_threads_side_by_side(server, tmp_path):
    exe = chromium()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            replay_on_page(page, server, ANNOTATED, "Give me two tips.")
            cols = page.query_selector_all(".thread")
            assert len(cols) == 3  # the main thread and one column per forked thread
            texts = [c.query_selector(".text").inner_text() for c in cols]
            assert texts[1] == "Sleep early, every day." and texts[2] == "Walk after lunch."
            assert "⟨1: sleep⟩" in texts[0] and "⟨2: walk⟩" in texts[0] and texts[0].endswith("That is all.")
            assert [c.get_attribute("data-status") for c in cols[1:]] == ["joined", "joined"]
            promises = [e.inner_text() for e in page.query_selector_all("#answer .promise")]
            chunks = [e.inner_text() for e in page.query_selector_all("#answer .chunk")]
            assert promises == ["sleep ~10", "walk ~10"]
            assert chunks == ["Sleep early, every day.", "Walk after lunch."]
            steps, decoded = int(page.inner_text("#steps")), int(page.inner_text("#seq-steps"))
            assert 0 < steps < decoded  # fewer decode steps than tokens decoded: threads ran side by side
            assert "content speedup" in page.inner_text("#final-stats")
            # the step timeline (issue 31 item 8): a bar per thread over decode steps, then sequential's
            rows = page.query_selector_all("#timeline .row")
            assert [r.get_attribute("data-kind") for r in rows] == ["thread"] * 3 + ["sequential"]
            bars = [r.query_selector(".bar") for r in rows]
            span = [(int(b.get_attribute("data-start")), int(b.get_attribute("data-end"))) for b in bars]
            assert span[0][0] == 0 and span[-1] == (0, decoded)
            assert all(0 < a <= b <= steps for a, b in span[1:3])  # each chunk lives inside the run
            assert max(b for _, b in span[:3]) == steps  # the last thread to end ends the run
            critical = ["critical" in b.get_attribute("class") for b in bars]
            assert critical[0] and sum(critical[1:3]) >= 1 and not critical[-1]
            w_main, w_seq = bars[0].bounding_box()["width"], bars[-1].bounding_box()["width"]
            assert w_main / w_seq == pytest.approx(span[0][1] / decoded, abs=0.02)  # drawn to one scale
            shot = tmp_path / "page.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert errors == []
        finally:
            browser.close()


APAR = ("Two tips:\n1. Sleep[Fork][Child] early, every day.[/Child]\n2. Walk[Fork][Child] after lunch.[/Child]\n"
        "That is all.")


def test_page_dialect_selector_sends_the_field_and_shows_any_dialects_threads(server):
    """The dialect selector sits next to the mode selector, offers every dialect of the registry
    and sends ``pasta.dialect``; an APAR replay (forks without topic or length) shows its threads
    and its spliced answer from the thread events, as a PASTA-LANG one does."""
    from pasta_engine.lang.dialect import DIALECT_NAMES, get_dialect

    get_dialect("apar")  # the APAR dialect's module (pasta_engine.lang.apar) must be in this tree
    exe = chromium()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            sent: list[dict] = []
            page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions")
                    else None)
            page.goto(server.url + "/")
            # next to the mode selector, in the same row of controls
            assert page.eval_on_selector("#dialect", "e => e.closest('.controls') === "
                                         "document.querySelector('#mode').closest('.controls')")
            assert [o.get_attribute("value") for o in page.query_selector_all("#dialect option")] == list(DIALECT_NAMES)
            assert page.input_value("#dialect") == "pasta"
            page.select_option("#dialect", "apar")
            page.click("summary")
            page.fill("#api-key", server.api_key)
            page.fill("#annotated", APAR)
            page.click("#run")
            page.wait_for_selector("body[data-state=done], body[data-state=error]", timeout=120_000)
            assert page.get_attribute("body", "data-state") == "done", page.inner_text("#error")
            assert len(sent) == 1 and sent[0]["pasta"]["dialect"] == "apar"
            assert sent[0]["pasta"]["annotated_response"] == APAR
            cols = page.query_selector_all(".thread")
            assert len(cols) == 3
            texts = [c.query_selector(".text").inner_text() for c in cols]
            assert texts[1].strip() == "early, every day." and texts[2].strip() == "after lunch."
            assert "⟨1⟩" in texts[0] and "⟨2⟩" in texts[0] and texts[0].endswith("That is all.")
            assert "[Fork]" not in page.inner_text("#threads") + page.inner_text("#answer")
            assert [c.get_attribute("data-status") for c in cols[1:]] == ["joined", "joined"]
            marks = [e.inner_text() for e in page.query_selector_all("#answer .promise")]
            chunks = [e.inner_text().strip() for e in page.query_selector_all("#answer .chunk")]
            assert marks == ["thread 1", "thread 2"] and chunks == ["early, every day.", "after lunch."]
            steps, decoded = int(page.inner_text("#steps")), int(page.inner_text("#seq-steps"))
            assert 0 < steps < decoded
            assert errors == []
        finally:
            browser.close()


SEVEN = "Tips:" + "".join(f'\n- <promise topic="tip {i}" tokens="10"/><async>Tip number {i} is a short one.</async>'
                          for i in range(1, 7)) + "\n<sync/>Done."


def test_seven_threads_all_stay_in_view_and_the_page_has_an_icon(server):
    """At seven threads in a 1280 px window every column is inside the window (they wrap onto a
    new row, where they used to run off the side with no hint that the row scrolls), and
    ``/favicon.ico`` is an icon, not a 404."""
    import httpx

    r = httpx.get(server.url + "/favicon.ico")
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml") and b"<svg" in r.content
    exe = chromium()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            replay_on_page(page, server, SEVEN, "Six tips.")
            cols = page.query_selector_all(".thread")
            assert len(cols) == 7
            for c in cols:
                box = c.bounding_box()
                assert box["x"] >= 0 and box["x"] + box["width"] <= 1280, box
            assert len(page.query_selector_all("#timeline .row")) == 8
        finally:
            browser.close()
