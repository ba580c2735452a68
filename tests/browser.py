"""Debian's chromium, headless, through Selenium and chromedriver, for the tests of pages.

Without the browser a test that needs it skips, naming the install line, on a developer's machine;
under CI (``CI`` set, as ``.ci/run`` sets it) it fails, so CI never passes without running it."""

import contextlib
import os
import shutil

import pytest

INSTALL = "apt-get install chromium chromium-driver"
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--autoplay-policy=no-user-gesture-required")


def require_chromium() -> None:
    """Skips (fails under CI) unless ``chromium`` and ``chromedriver`` are on the PATH."""
    if shutil.which("chromium") and shutil.which("chromedriver"):
        return
    message = f"this test drives Debian's chromium: {INSTALL}"
    if os.environ.get("CI"):
        pytest.fail(f"CI is set and chromium or chromedriver is missing; {message}")
    pytest.skip(message)


@contextlib.contextmanager
def chromium():
    """A headless chromium driver, quit on exit."""
    require_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        yield driver
    finally:
        driver.quit()
