"""Screenshot of the page ``pasta-engine serve`` shows at ``/``, after one prompt has decoded.

    pasta-engine serve --port 8000 &
    python docs/screenshot_page.py --url http://127.0.0.1:8000 --out docs/serve_page.png

Drives the system's Chromium (Debian's ``chromium``, or ``--chromium PATH``) with Playwright;
exits 1 when the page ends in an error or does not finish within ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from urllib.parse import quote

from playwright.sync_api import sync_playwright

SAMPLE_PROMPT = "What are different drawers I should have for clothes?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", default="docs/serve_page.png")
    ap.add_argument("--prompt", default=SAMPLE_PROMPT)
    ap.add_argument("--annotated", default=None, help="replay this annotated response instead of generating")
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    args = ap.parse_args()
    if not args.chromium:
        print("no Chromium found: apt-get install chromium, or pass --chromium PATH", file=sys.stderr)
        return 2
    query = "?autorun=1&prompt=" + quote(args.prompt) + ("&annotated=" + quote(args.annotated) if args.annotated else "")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": args.width, "height": 800})
            page.goto(args.url.rstrip("/") + "/" + query)
            page.wait_for_selector("body[data-state=done], body[data-state=error]", timeout=args.timeout_s * 1000)
            state = page.get_attribute("body", "data-state")
            page.screenshot(path=args.out, full_page=True)
            print(f"wrote {args.out} (page state: {state}; {page.inner_text('#counters')})")
            return 0 if state == "done" else 1
        finally:
            browser.close()


if __name__ == "__main__":
    sys.exit(main())
