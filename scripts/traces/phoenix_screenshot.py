"""Screenshots of traces in Phoenix's own UI, with headless Chromium (Debian's chromium + chromedriver,
`make browser`) driven by selenium.

    python scripts/traces/phoenix_screenshot.py --url http://127.0.0.1:6006 --project weather-agent \
        --output runs/phoenix-weather-agent.png [--trace TRACE_ID]

Without --trace: the project's trace list; with it: that trace's page (its spans and attributes).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time

import httpx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:6006")
    parser.add_argument("--project", required=True)
    parser.add_argument("--trace", help="a trace id: its page instead of the list")
    parser.add_argument("--output", required=True)
    parser.add_argument("--wait-s", type=float, default=8.0, help="time for the page to render")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not (chromium and driver_path):
        sys.exit("phoenix_screenshot: Debian's chromium and chromium-driver are needed (make browser)")
    base = args.url.rstrip("/")
    projects = httpx.get(f"{base}/v1/projects", timeout=10).json()["data"]
    project = next((p for p in projects if p["name"] == args.project), None)
    if project is None:
        sys.exit(f"phoenix_screenshot: Phoenix at {base} has no project {args.project!r} "
                 f"({', '.join(p['name'] for p in projects)})")
    page = f"{base}/projects/{project['id']}" + (f"/traces/{args.trace}" if args.trace else "")

    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1600,1000", "--no-first-run"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver_path), options=options)
    try:
        driver.set_page_load_timeout(60)
        driver.get(page)
        time.sleep(args.wait_s)
        driver.save_screenshot(args.output)
    finally:
        driver.quit()
    print(f"{page} -> {args.output}")


if __name__ == "__main__":
    main()
