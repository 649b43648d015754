"""Driving the chat page in a real headless Chromium (Debian's `chromium` and `chromium-driver`, through `selenium`),
for the tests that open it against a real station: tests/test_web.py, and tests/test_lora.py's LoRA station.
conftest.py's `browser` fixture starts the browser with `chromium`.

`Recorder` is a middleware that keeps the body of every chat and /tokenize request the station receives, so a test
reads what the page sent from the station's side.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

CHROMEDRIVER = "/usr/bin/chromedriver"
RECORDED = ("/v1/chat/completions", "/tokenize")


def chromium() -> WebDriver:
    assert shutil.which("chromium") and shutil.which(CHROMEDRIVER), "install Debian's chromium and chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,800"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


class Recorder:
    """Pure ASGI: appends (path, body) of every request to one of RECORDED to `sent`."""

    def __init__(self, app: Any, sent: list[tuple[str, bytes]]) -> None:
        self.app, self.sent = app, sent

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in RECORDED:
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []

        async def recording() -> Any:
            message = await receive()
            chunks.append(message.get("body", b""))
            if message["type"] == "http.request" and not message.get("more_body"):
                self.sent.append((scope["path"], b"".join(chunks)))
            return message

        await self.app(scope, recording, send)


def sent_to(sent: list[tuple[str, bytes]], path: str) -> list[dict]:
    """The bodies of the requests to `path` a `Recorder` kept, in order."""
    return [json.loads(body) for to, body in sent if to == path]


def wait(driver: WebDriver, predicate, message: str, timeout: float = 30) -> object:
    # the page redraws a message as it streams: an element read between its removal and its redraw is stale
    return WebDriverWait(driver, timeout, 0.05, ignored_exceptions=(StaleElementReferenceException,)).until(
        predicate, message)


def open_page(driver: WebDriver, port: int, key: str | None = None) -> WebDriver:
    """The page of the station on `port`, freshly loaded with empty storage (and the API key `key` already given),
    once it reads the station as ready."""
    driver.get(f"http://127.0.0.1:{port}/")
    driver.execute_script("localStorage.clear(); if (arguments[0]) localStorage.setItem('jaxstation.key', "
                          "arguments[0])", key)
    reload(driver)
    return driver


def reload(driver: WebDriver) -> None:
    """Reload the page and wait until it has seen the station ready (and drawn the conversation again)."""
    driver.refresh()
    wait(driver, lambda d: d.find_element(By.ID, "send").is_enabled(), "the page did not see the station ready")


def ask(driver: WebDriver, text: str, max_tokens: int) -> None:
    """Send `text` as the next turn, greedy (temperature 0), for at most `max_tokens` tokens."""
    if driver.find_element(By.ID, "settings").get_attribute("open") is None:
        driver.find_element(By.CSS_SELECTOR, "#settings summary").click()
    for field, value in (("temperature", "0"), ("max-tokens", str(max_tokens))):
        driver.find_element(By.ID, field).clear()
        driver.find_element(By.ID, field).send_keys(value)
    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()


def answer_meta(driver: WebDriver) -> str:
    metas = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta span")
    return metas[-1].text if metas else ""


def finished(driver: WebDriver) -> None:
    wait(driver, lambda d: "tokens/s" in answer_meta(d), "the answer did not finish")
