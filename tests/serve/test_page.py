"""The page at `/`, in a real headless browser (Debian's chromium through Selenium and chromedriver):
it loads with the server's voices, speaks as the audio streams (pcm through Web Audio, mp3 through
Media Source), and shows the time to first audio and the chunk gaps."""

import time

import httpx
import pytest
from helpers import NARROW
from browser import chromium
from live_server import serving

from snac_fast import FastSNAC
from snac_fast.model.synthetic import synthetic_model

FRAME_S = 2048 / 24000


@pytest.fixture(scope="module")
def browser():
    """Headless chromium (.ci/run installs Debian's chromium and chromium-driver)."""
    with chromium() as driver:
        yield driver


def wait_for(driver, element: str, text: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while (value := driver.find_element("id", element).text) != text and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


@pytest.mark.heavy
@pytest.mark.parametrize("response_format", ["pcm", "mp3"])
def test_the_page_speaks_as_the_audio_streams(browser, response_format):
    from selenium.webdriver.support.ui import Select

    codec = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", fuse=False)
    with serving(codec, api_key="sesame", voices="tara,leo") as (server, lm, _):
        lm.pace, lm.frames = 1.0, 24  # real time: 2 s of audio arriving over 2 s
        assert httpx.get(server.url + "/").status_code == 200  # the page needs no key; the API does
        browser.get(server.url + "/")
        browser.find_element("id", "key").send_keys("sesame")
        browser.execute_script("document.getElementById('key').dispatchEvent(new Event('change'))")
        deadline = time.monotonic() + 30
        while len(Select(browser.find_element("id", "voice")).options) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [o.text for o in Select(browser.find_element("id", "voice")).options] == ["tara", "leo"]
        Select(browser.find_element("id", "voice")).select_by_visible_text("leo")
        Select(browser.find_element("id", "format")).select_by_value(response_format)
        browser.find_element("id", "speak").click()
        status = wait_for(browser, "status", "done")
        time.sleep(2.5)  # the audio plays on
        figures = {name: browser.find_element("id", name).text for name in
                   ("ttfa", "chunks", "gaps", "received", "played", "error")}
    assert status == "done", figures
    assert "leo: " in lm.prompts[-1]
    assert figures["ttfa"].endswith(" ms") and 0 < float(figures["ttfa"].split()[0]) < 10_000, figures
    assert int(figures["chunks"]) > 3 and figures["gaps"].endswith(" ms"), figures
    assert float(figures["received"].split()[0]) == pytest.approx(24 * FRAME_S, abs=0.1), figures
    assert float(figures["played"].split()[0]) > 0.5, figures  # the browser played it
    assert figures["error"] == ""
