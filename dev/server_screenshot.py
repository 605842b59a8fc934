"""Screenshots of the live page served by `verispec serve` on a real model, taken in headless Chromium.

Starts the server, chats once and runs one race through the page (selenium + Debian's chromium and
chromium-driver), and saves <out>/server_page_chat.png and <out>/server_page.png (the race view).

    python -m dev.server_screenshot --model smollm2-135m --out docs/images
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,860", "--force-device-scale-factor=1"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--out", default="docs/images")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the server (serve --threads)")
    ap.add_argument("--chat", default="Write a Python function that returns the squares of a list of numbers.")
    ap.add_argument("--race", default="Repeat this list in reverse order: apple, banana, cherry, date, elderberry, fig, grape.")
    args = ap.parse_args()

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", "from verispec.cli import app; app()", "serve", "--model", args.model,
           "--method", "ngram", "--port", str(args.port), "--log-level", "warning"]
    server = subprocess.Popen(cmd + (["--threads", str(args.threads)] if args.threads else []))
    url = f"http://127.0.0.1:{args.port}"
    profile = tempfile.mkdtemp(prefix="verispec-chromium-")
    driver = None
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        options = webdriver.ChromeOptions()
        options.binary_location = "/usr/bin/chromium"
        for flag in FLAGS + [f"--user-data-dir={profile}"]:
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        state = lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state")  # noqa: E731
        driver.get(url + "/")
        WebDriverWait(driver, 60).until(lambda d: state(d) == "idle")
        mt = driver.find_element(By.ID, "max-tokens")
        mt.clear()
        mt.send_keys(str(args.max_tokens))
        driver.find_element(By.ID, "prompt").send_keys(args.chat)
        driver.find_element(By.ID, "send").click()
        WebDriverWait(driver, 900, 0.2).until(lambda d: state(d) in ("done", "error"))
        driver.save_screenshot(str(out / "server_page_chat.png"))
        driver.find_element(By.ID, "tab-race").click()
        box = driver.find_element(By.ID, "race-prompt")
        box.clear()
        box.send_keys(args.race)
        driver.find_element(By.ID, "race-go").click()
        WebDriverWait(driver, 900, 0.2).until(lambda d: state(d) in ("done", "error"))
        driver.save_screenshot(str(out / "server_page.png"))
        print(driver.find_element(By.ID, "race-result").text or driver.find_element(By.ID, "error").text)
    finally:
        if driver is not None:
            driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
        server.terminate()
        server.wait(timeout=20)


if __name__ == "__main__":
    main()
