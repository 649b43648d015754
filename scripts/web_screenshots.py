"""Write the chat page's screenshots in docs/ (docs/web.md shows them): the page light, the page dark with the station
panel open, and the panel while four requests run. The pictures are of a real station on the default model, a real
conversation with it and a real headless Chromium, so they show what the page does, not a mock-up.

Needs the test extra's selenium and Debian's chromium and chromium-driver: python scripts/web_screenshots.py
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import uvicorn
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from jaxstation.app import create_app
from jaxstation.config.settings import StationConfig
from jaxstation.server.station import Station

DOCS = Path(__file__).resolve().parent.parent / "docs"
CONFIG = StationConfig(lanes=4, max_seq=1024, continuous=True, served_model_name=("SmolLM2-135M-Instruct",))
QUESTION = "Write a Python function that returns the squares of a list of numbers."
BUSY = "Tell me a long story about a lighthouse keeper and a seal."
WINDOW = (1180, 760)


def serve(station: Station) -> tuple[uvicorn.Server, threading.Thread, int]:
    """The station's app on a loopback port, in a thread; its lifespan starts the station and drains it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(station), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    return server, thread, sock.getsockname()[1]


def wait(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} within {timeout} s")
        time.sleep(0.2)


def ready(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/ready").status == 200
    except OSError:
        return False


def chat(port: int, text: str, max_tokens: int) -> None:
    """Ask the station directly, for `max_tokens` tokens whatever the model would say (so its lane stays busy)."""
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=600).read()


def browser() -> WebDriver:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={WINDOW[0]},{WINDOW[1]}",
                "--hide-scrollbars"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))


def busy_lanes(driver: WebDriver) -> int:
    return len(driver.find_elements(By.CSS_SELECTOR, "#lanes li[data-state='prefilling'], "
                                                     "#lanes li[data-state='decoding']"))


def main() -> None:
    server, thread, port = serve(Station(CONFIG))
    wait(lambda: ready(port), 900, "the station did not turn ready")
    driver = browser()
    until = WebDriverWait(driver, 300, 0.1).until
    try:
        driver.get(f"http://127.0.0.1:{port}/")
        driver.execute_script("localStorage.clear(); localStorage.setItem('jaxstation.theme', 'light'); "
                              "localStorage.setItem('jaxstation.settings', JSON.stringify({seed: '7'}))")
        driver.refresh()
        until(lambda d: d.find_element(By.ID, "send").is_enabled())
        driver.find_element(By.ID, "prompt").send_keys(QUESTION + "\n")
        until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta"))
        driver.save_screenshot(str(DOCS / "chat-page.png"))

        driver.find_element(By.ID, "theme").click()  # light -> auto
        driver.find_element(By.ID, "theme").click()  # auto -> dark
        driver.find_element(By.ID, "station-toggle").click()
        until(lambda d: d.find_elements(By.CSS_SELECTOR, "#lanes li"))
        runs = [threading.Thread(target=chat, args=(port, BUSY, 800)) for _ in range(4)]
        for run in runs:
            run.start()
        until(lambda d: busy_lanes(d) == 4 and "decoding" in d.find_element(By.ID, "lanes").text)
        time.sleep(11)  # two buckets of throughput in the chart
        (DOCS / "station-panel.png").write_bytes(driver.find_element(By.ID, "station").screenshot_as_png)
        driver.save_screenshot(str(DOCS / "chat-page-dark.png"))
        if busy_lanes(driver) != 4:
            raise SystemExit("the requests ended before the screenshots: give them more tokens")
        for run in runs:
            run.join()
    finally:
        driver.quit()
        server.should_exit = True
        thread.join(30)
    print("wrote", ", ".join(str(DOCS / n) for n in ("chat-page.png", "chat-page-dark.png", "station-panel.png")))


if __name__ == "__main__":
    main()
