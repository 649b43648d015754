"""The chat page at `/`, driven in a real headless Chromium (the system's `chromium` and `chromium-driver`) against a
real station on the default model: a streamed answer, the stop button cancelling the request on the station,
conversations surviving a reload, and model output that cannot run script however hostile its markdown."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait
from server_util import ServerThread, metric, wait_for
from starlette.testclient import TestClient

from jaxstation.app import create_app
from jaxstation.cli import build_parser
from jaxstation.config.settings import StationConfig, resolve
from jaxstation.model.loader import LoadedModel
from jaxstation.server.station import Station

SHAPE = {"lanes": 4, "max_seq": 512, "prefill_chunk": 32, "kv_block": 128}
KEY = "k3y"
CHROMEDRIVER = "/usr/bin/chromedriver"
HOSTILE = """# Title <script>window.__pwned = 1</script>
<img src=x onerror="window.__pwned = 2"> and **bold <b>x</b>** and *it* and `<i>code</i>`
[click](javascript:window.__pwned=3) [data](data:text/html,<script>window.__pwned=4</script>) [ok](https://example.com/a)

- one <svg onload="window.__pwned=5">
- two

```html
<script>window.__pwned = 6</script>
```"""


@pytest.fixture(scope="module")
def station(default_model: LoadedModel):
    st = Station(StationConfig(**SHAPE, continuous=True, drain_s=5, api_key=KEY), model=default_model)
    with ServerThread(create_app(st)) as server, server.client() as http:
        wait_for(lambda: http.get("/ready").status_code == 200, 120, "the station did not turn ready", 0.1)
        yield st, server, http


@pytest.fixture(scope="module")
def browser() -> WebDriver:
    assert shutil.which("chromium") and shutil.which(CHROMEDRIVER), "install Debian's chromium and chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


@pytest.fixture
def page(station, browser: WebDriver) -> WebDriver:
    """The page, freshly loaded with empty storage, once the station reads as ready, the API key already given."""
    browser.get(f"http://127.0.0.1:{station[1].port}/")
    browser.execute_script("localStorage.clear(); localStorage.setItem('jaxstation.key', arguments[0])", KEY)
    browser.refresh()
    wait(browser, lambda d: d.find_element(By.ID, "send").is_enabled(), "the page did not see the station ready")
    return browser


def wait(driver: WebDriver, predicate, message: str, timeout: float = 30) -> object:
    return WebDriverWait(driver, timeout, 0.05).until(predicate, message)


def ask(driver: WebDriver, text: str, max_tokens: int) -> None:
    driver.find_element(By.CSS_SELECTOR, "#settings summary").click()
    for field, value in (("temperature", "0"), ("max-tokens", str(max_tokens))):
        driver.find_element(By.ID, field).clear()
        driver.find_element(By.ID, field).send_keys(value)
    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()


def answer_meta(driver: WebDriver) -> str:
    metas = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta span")
    return metas[-1].text if metas else ""


def test_page_is_static_and_strict(station) -> None:
    http = station[2]
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe" not in csp
    assert "<script src=\"/web/app.js\"" in page.text and "http" not in page.text.split("<body>")[0]
    assert http.get("/web/app.js").headers["content-type"].startswith("text/javascript")
    assert http.get("/web/nothing.js").status_code == 404
    assert http.post("/v1/chat/completions", json={"messages": []}).status_code == 401  # the API keeps its key


def test_no_web_turns_the_page_off(default_model: LoadedModel) -> None:
    assert resolve(build_parser().parse_args(["serve", "--no-web"]), env={}, command="serve").web is False
    assert resolve(None, env={"MOONSHINE_WEB": "off"}, command="serve").web is False
    app = create_app(Station(StationConfig(**SHAPE, web=False), model=default_model))
    client = TestClient(app)  # no lifespan: the routes alone
    assert client.get("/").status_code == 404 and client.get("/web/app.js").status_code == 404


def test_asks_for_the_key_then_streams_an_answer_kept_across_reloads(page: WebDriver) -> None:
    page.execute_script("localStorage.removeItem('jaxstation.key')")
    ask(page, "What is the capital of France?", 24)
    wait(page, lambda d: d.find_element(By.ID, "key-dialog").is_displayed(), "no key asked for on a 401")
    page.find_element(By.ID, "key").send_keys(KEY + "\n")
    wait(page, lambda d: "tokens/s" in answer_meta(d), "the answer did not finish")
    assert re.fullmatch(r"[\d.]+ tokens/s · prompt \d+ · completion \d+", answer_meta(page))
    answer = page.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].text
    assert answer.strip(), "the answer is empty"
    page.refresh()
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant"), "the conversation is gone")
    assert page.find_element(By.CSS_SELECTOR, "#chats li.current .title").text.startswith("What is the capital")
    assert page.find_element(By.CSS_SELECTOR, ".msg.user").text.startswith("What is the capital of France?")


def test_stop_cancels_the_request_on_the_station(station, page: WebDriver) -> None:
    st, _, http = station
    cancelled = metric(http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).text,
                       "jaxstation_requests_total", {"outcome": "cancelled"})
    ask(page, "Write a very long story about a dragon who learns to bake bread.", 400)

    def streaming(d: WebDriver) -> bool:
        shown = d.find_elements(By.CSS_SELECTOR, ".msg.assistant")
        return d.find_element(By.ID, "stop").is_displayed() and bool(shown) and len(shown[-1].text) > 20

    wait(page, streaming, "no answer streamed in")
    assert st.scheduler.busy_lanes == 1
    page.find_element(By.ID, "stop").click()
    wait(page, lambda d: answer_meta(d) == "stopped", "the page did not stop")
    wait_for(lambda: st.scheduler.busy_lanes == 0 and not st.scheduler.pending, 10, "the lane was not freed")
    text = http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert metric(text, "jaxstation_requests_total", {"outcome": "cancelled"}) == cancelled + 1


def test_hostile_markdown_renders_as_text(page: WebDriver) -> None:
    html = page.execute_script("""
        const box = document.createElement('div');
        box.id = 'hostile';
        box.append(window.jaxstation.renderMarkdown(arguments[0]));
        document.body.append(box);
        return box.innerHTML;""", HOSTILE)
    page.execute_script("return new Promise((done) => setTimeout(done, 300))")  # let any onerror/onload fire
    assert page.execute_script("return window.__pwned") is None
    assert no_active_content(page, "#hostile"), html
    assert page.find_element(By.CSS_SELECTOR, "#hostile a").get_attribute("href") == "https://example.com/a"
    assert page.find_element(By.CSS_SELECTOR, "#hostile pre code").text == "<script>window.__pwned = 6</script>"
    assert [e.tag_name for e in page.find_elements(By.CSS_SELECTOR, "#hostile h3, #hostile strong, #hostile em, "
                                                   "#hostile ul li")] == ["h3", "strong", "em", "li", "li"]


def test_stored_answers_show_reasoning_folded_and_tool_calls(page: WebDriver) -> None:
    chat = {"id": "c1", "title": "hostile", "messages": [
        {"role": "user", "content": "<script>window.__pwned = 7</script>"},
        {"role": "assistant", "content": "<think>plan <img src=x onerror=\"window.__pwned=8\"></think>" + HOSTILE,
         "reasoning": "", "tools": [{"name": "get_weather<script>", "arguments": "{\"city\": \"<b>Paris</b>\"}"}]}]}
    page.execute_script("localStorage.setItem('jaxstation.chats', arguments[0])", json.dumps([chat]))
    page.refresh()
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant details"), "no folded reasoning")
    page.execute_script("return new Promise((done) => setTimeout(done, 300))")
    assert page.execute_script("return window.__pwned") is None
    assert no_active_content(page, "#messages")
    details = page.find_element(By.CSS_SELECTOR, ".msg.assistant details")
    assert details.get_attribute("open") is None
    assert "get_weather<script>" in page.find_element(By.CSS_SELECTOR, ".msg.assistant .tool").text


def no_active_content(driver: WebDriver, root: str) -> bool:
    """No script, img, svg or iframe under `root`, no on* attribute, and every link http(s)."""
    return driver.execute_script("""
        const root = document.querySelector(arguments[0]);
        const all = [...root.querySelectorAll('*')];
        return !root.querySelector('script, img, svg, iframe, object, embed')
            && all.every((e) => [...e.attributes].every((a) => !a.name.startsWith('on')))
            && [...root.querySelectorAll('a')].every((a) => /^https?:/.test(a.href));""", root)


def test_regenerate_edit_and_import(page: WebDriver, tmp_path) -> None:
    ask(page, "Say hi.", 8)
    wait(page, lambda d: "tokens/s" in answer_meta(d), "the answer did not finish")
    first = page.find_element(By.CSS_SELECTOR, ".msg.assistant").text.split("\n")[0]
    page.find_element(By.XPATH, "//button[text()='Regenerate']").click()
    wait(page, lambda d: "tokens/s" in answer_meta(d), "the regenerated answer did not finish")
    assert page.find_element(By.CSS_SELECTOR, ".msg.assistant").text.split("\n")[0] == first  # greedy: the same
    page.find_element(By.XPATH, "//button[text()='Edit']").click()
    area = page.find_element(By.CSS_SELECTOR, ".msg.user textarea")
    area.clear()
    area.send_keys("Say bye.")
    page.find_element(By.XPATH, "//div[contains(@class, 'user')]/button[text()='Send']").click()
    wait(page, lambda d: "tokens/s" in answer_meta(d), "the answer to the edit did not finish")
    assert [m.text.split("\n")[0] for m in page.find_elements(By.CSS_SELECTOR, ".msg.user")] == ["Say bye."]
    assert len(page.find_elements(By.CSS_SELECTOR, ".msg")) == 2
    exported = [{"title": "imported", "messages": [{"role": "system", "content": "dropped"},
                                                   {"role": "user", "content": "<img src=x onerror=alert(1)>"}]}]
    (tmp_path / "chats.json").write_text(json.dumps(exported))
    page.find_element(By.ID, "import").send_keys(str(tmp_path / "chats.json"))
    wait(page, lambda d: d.find_element(By.CSS_SELECTOR, "#chats li.current .title").text == "imported", "no import")
    assert [m.text.split("\n")[0] for m in page.find_elements(By.CSS_SELECTOR, ".msg")] == [
        "<img src=x onerror=alert(1)>"]
    assert len(page.find_elements(By.CSS_SELECTOR, "#chats li")) == 2
