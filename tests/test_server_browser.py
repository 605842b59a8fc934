"""The live page in headless Chromium (Debian's chromium + chromium-driver, driven by selenium): load the
page, chat, see tokens coloured by kind with step boundaries, run the race, save screenshots.

Chromium is required: without /usr/bin/chromium this test fails with the install command, unless
VERISPEC_SKIP_BROWSER=1 says to skip it on purpose. Screenshots go to $VERISPEC_SCREENSHOT_DIR if set,
else to pytest's tmp dir.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from server_helpers import ServerThread, tiny_target
from verispec.server import ServerConfig, create_app

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
INSTALL = "apt-get update && apt-get install -y chromium chromium-driver"
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,900", "--force-device-scale-factor=1"]


def chrome(user_data_dir: str):
    """A selenium driver for Debian's headless chromium; fails (not skips) when it is missing."""
    if os.environ.get("VERISPEC_SKIP_BROWSER") == "1":
        pytest.skip("VERISPEC_SKIP_BROWSER=1: browser test skipped on purpose")
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            pytest.fail(f"{path} is missing: the browser test needs Debian's chromium; run: {INSTALL} "
                        "(or set VERISPEC_SKIP_BROWSER=1 to skip it)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium is not installed; run: pip install -e '.[dev]' (or pip install selenium)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS + [f"--user-data-dir={user_data_dir}"]:
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def wait_state(driver, states=("done", "error"), seconds=90):
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, seconds, poll_frequency=0.1).until(
        lambda d: d.find_element("tag name", "body").get_attribute("data-state") in states)
    return driver.find_element("tag name", "body").get_attribute("data-state")


@pytest.fixture(scope="module")
def page_server():
    config = ServerConfig(method="ngram", draft_length=4, default_max_tokens=24, max_tokens=64)
    with ServerThread(create_app(tiny_target(), config)) as s:
        yield s


def test_page_chat_and_race_in_chromium(page_server, tmp_path):
    from selenium.webdriver.common.by import By

    shots = Path(os.environ.get("VERISPEC_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    profile = tempfile.mkdtemp(prefix="verispec-chromium-")
    driver = chrome(profile)
    try:
        driver.get(page_server.url + "/")
        assert wait_state(driver, ("idle", "error"), 30) == "idle"
        assert driver.find_element(By.ID, "model-name").text == "tiny-words"

        # a repetitive prompt, so the n-gram drafter has something to match and drafts get accepted
        driver.find_element(By.ID, "max-tokens").clear()
        driver.find_element(By.ID, "max-tokens").send_keys("40")
        driver.find_element(By.ID, "prompt").send_keys("the cat sat on the mat the cat sat on the mat")
        driver.find_element(By.ID, "send").click()
        assert wait_state(driver) == "done", driver.find_element(By.ID, "error").text
        body = driver.find_element(By.CSS_SELECTOR, ".msg.assistant .body")
        tokens = body.find_elements(By.CSS_SELECTOR, ".tok")
        steps = body.find_elements(By.CSS_SELECTOR, ".step")
        assert len(tokens) == 40
        kinds = {c for t in tokens for c in t.get_attribute("class").split() if c.startswith("tok-")}
        assert kinds <= {"tok-accepted", "tok-recovered", "tok-bonus"} and kinds
        assert 1 <= len(steps) <= 40
        meta = driver.find_element(By.CSS_SELECTOR, ".msg.assistant .meta").text
        assert "40 tokens" in meta and "ngram" in meta
        stats = driver.find_element(By.ID, "chat-stats").text
        assert "mean accepted length" in stats and "–" not in stats.split("tokens/s")[1].split("·")[0]
        driver.save_screenshot(str(shots / "server_page_chat.png"))

        driver.find_element(By.ID, "tab-race").click()
        driver.find_element(By.ID, "race-go").click()
        assert wait_state(driver) == "done", driver.find_element(By.ID, "error").text
        lanes = [driver.find_element(By.ID, f"lane-{i}") for i in (0, 1)]
        plain = lanes[0].find_elements(By.CSS_SELECTOR, ".tok")
        spec = lanes[1].find_elements(By.CSS_SELECTOR, ".tok")
        assert len(plain) == len(spec) == 40
        assert all("tok-bonus" in t.get_attribute("class") for t in plain)  # plain decoding drafts nothing
        assert [t.text for t in plain] == [t.text for t in spec]
        result = driver.find_element(By.ID, "race-result").text
        assert "identical" in result and "×" in result
        driver.save_screenshot(str(shots / "server_page_race.png"))
        assert (shots / "server_page_race.png").stat().st_size > 10_000
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
