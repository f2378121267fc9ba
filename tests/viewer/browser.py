"""Debian's chromium, headless, driven by Selenium through chromium-driver (no browser
download: `scripts/setup.sh --dev` installs both with apt).

Also a screenshot tool for the README:
    python -m tests.viewer.browser RUN_DIR OUT.png [#/route]
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--window-size=1400,1000",
)


def missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if shutil.which(path) is None:
            return f"{path} not found: run scripts/setup.sh --dev (apt-get install chromium chromium-driver)"
    return None


def start_chromium() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    return driver


def full_page_screenshot(driver: Any, out: Path, width: int = 1400, max_height: int = 4000) -> Path:
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(width, min(max(int(height) + 20, 700), max_height))
    time.sleep(0.3)  # let the resize lay out before the capture
    out.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(out))
    return out


def main(argv: list[str]) -> int:
    from rollover.viewer.app import ViewerThread
    from rollover.viewer.data import RunFolder

    run_dir, out = Path(argv[0]), Path(argv[1])
    route = argv[2] if len(argv) > 2 else "#/"
    with ViewerThread(RunFolder(run_dir)) as viewer:
        driver = start_chromium()
        try:
            from selenium.webdriver.support.ui import WebDriverWait

            driver.get(viewer.landing_url + route)
            WebDriverWait(driver, 120).until(lambda d: d.execute_script("return document.body.dataset.rendered"))
            time.sleep(1)
            print(full_page_screenshot(driver, out))
        finally:
            driver.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
