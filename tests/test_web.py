"""The chat page at `/`, driven in a real headless Chromium (the system's `chromium` and `chromium-driver`) against a
real station on the default model: a streamed answer, the stop button cancelling the request on the station,
conversations surviving a reload, model output that cannot run script however hostile its markdown, the model picker,
code blocks highlighted and copied, the context left, attached files, dark mode and the station panel. A long answer
streamed by a stand-in for the station's stream draws each block once; a bad import, a malformed event and a full
localStorage each show a notice, never an uncaught error.

The station serves two names (`--served-model-name`) for the picker; it holds no LoRA slots, which would compile
programs of their own: tests/test_lora.py picks an adapter on the page against its LoRA station. A recording
middleware (tests/browser_util.py) keeps the body of every chat and /tokenize request the station receives, so the tests
read what the page sent from the station's side.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from browser_util import Recorder, answer_meta, ask, finished, open_page, reload, sent_to, wait
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select
from server_util import ServerThread, metric, wait_for
from starlette.testclient import TestClient

from jaxstation.app import create_app
from jaxstation.cli import build_parser
from jaxstation.config.settings import StationConfig, resolve
from jaxstation.model.loader import LoadedModel
from jaxstation.server.station import Station

SHAPE = {"lanes": 4, "max_seq": 512, "prefill_chunk": 32, "kv_block": 128}
KEY = "k3y"
NAMES = ("smollm2", "smollm2-b")
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
    """The station, its server, a client, and what the page sent it (`Recorder`)."""
    st = Station(StationConfig(**SHAPE, continuous=True, drain_s=5, api_key=KEY, served_model_name=NAMES),
                 model=default_model)
    app, sent = create_app(st), []
    app.add_middleware(Recorder, sent=sent)
    with ServerThread(app) as server, server.client() as http:
        wait_for(lambda: http.get("/ready").status_code == 200, 120, "the station did not turn ready", 0.1)
        yield st, server, http, sent


@pytest.fixture
def page(station, browser: WebDriver) -> WebDriver:
    """The page, freshly loaded with empty storage, once the station reads as ready, the API key already given."""
    return open_page(browser, station[1].port, KEY)


def test_page_is_static_and_strict(station) -> None:
    http = station[2]
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe" not in csp
    assert "<script type=\"module\" src=\"/web/app.js\">" in page.text and "http" not in page.text.split("<body>")[0]
    modules, seen = ["app.js"], set()
    while modules:  # every module the page imports is served, as JavaScript, under the same policy
        name = modules.pop()
        seen.add(name)
        reply = http.get(f"/web/{name}")
        assert reply.headers["content-type"].startswith("text/javascript"), name
        assert reply.headers["content-security-policy"] == csp
        assert "window.jaxstation" not in reply.text, name  # no hook for tests in the page users get
        modules += [m for m in re.findall(r'from "\./([\w-]+\.js)"', reply.text) if m not in seen]
    assert {"answer.js", "markdown.js", "highlight.js", "models.js", "files.js", "station.js"} <= seen
    assert http.get("/web/nothing.js").status_code == 404
    assert http.post("/v1/chat/completions", json={"messages": []}).status_code == 401  # the API keeps its key
    assert http.get("/station/status").status_code == 401


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
    reload(page)
    assert page.find_elements(By.CSS_SELECTOR, ".msg.assistant"), "the conversation is gone"
    assert page.find_element(By.CSS_SELECTOR, "#chats li.current .title").text.startswith("What is the capital")
    assert page.find_element(By.CSS_SELECTOR, ".msg.user").text.startswith("What is the capital of France?")


def test_stop_cancels_the_request_on_the_station(station, page: WebDriver) -> None:
    st, _, http, _ = station
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


def rendered(driver: WebDriver, text: str, box_id: str) -> str:
    """`text` rendered by the page's own markdown module into a new element `box_id`; its HTML."""
    return driver.execute_async_script("""
        const [text, id, done] = arguments;
        import('/web/markdown.js').then(({ renderMarkdown }) => {
          const box = document.createElement('div');
          box.id = id;
          box.append(renderMarkdown(text));
          document.body.append(box);
          done(box.innerHTML);
        });""", text, box_id)


def test_hostile_markdown_renders_as_text(page: WebDriver) -> None:
    html = rendered(page, HOSTILE, "hostile")
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
    reload(page)
    assert page.find_elements(By.CSS_SELECTOR, ".msg.assistant details"), "no folded reasoning"
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
    # the page checks the edited turn's length with the station before it sends it, showing the old turn meanwhile
    wait(page, lambda d: [m.text.split("\n")[0] for m in d.find_elements(By.CSS_SELECTOR, ".msg.user")] == ["Say bye."],
         "the edited turn was not sent")
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


def test_the_picker_lists_the_models_and_each_request_carries_its_conversations(station, page: WebDriver) -> None:
    wait(page, lambda d: len(Select(d.find_element(By.ID, "model")).options) == 2, "no models listed")
    picker = Select(page.find_element(By.ID, "model"))
    assert [o.text for o in picker.options] == list(NAMES)
    picker.select_by_value("smollm2-b")
    page.find_element(By.CSS_SELECTOR, "#settings summary").click()
    assert [page.find_element(By.ID, f).get_attribute("value") for f in ("temperature", "top-k", "top-p", "min-p")] == [
        "0.8", "40", "0.95", "0.05"]  # llama.cpp's web UI defaults until changed
    page.find_element(By.CSS_SELECTOR, "#settings summary").click()
    ask(page, "Say hi.", 4)
    finished(page)
    body = sent_to(station[3], "/v1/chat/completions")[-1]
    assert body["model"] == "smollm2-b" and sent_to(station[3], "/tokenize")[-1]["model"] == "smollm2-b"
    assert (body["temperature"], body["top_k"], body["top_p"], body["min_p"]) == (0, 40, 0.95, 0.05)
    page.find_element(By.ID, "new-chat").click()
    Select(page.find_element(By.ID, "model")).select_by_value("smollm2")
    reload(page)  # the first conversation keeps its model, the new one its own
    assert Select(page.find_element(By.ID, "model")).first_selected_option.text == "smollm2"
    page.find_element(By.XPATH, "//button[@class='title' and text()='Say hi.']").click()
    assert Select(page.find_element(By.ID, "model")).first_selected_option.text == "smollm2-b"


CODE = "def square(x):\n    return x * x  # \"<b>\"\n"


def test_code_blocks_are_highlighted_and_copied(page: WebDriver) -> None:
    chat = {"id": "c1", "title": "code", "messages": [
        {"role": "user", "content": "code please"},
        {"role": "assistant", "content": f"Here:\n\n```python\n{CODE}```\n\n```text\nplain <i>x</i>\n```",
         "reasoning": "", "tools": []}]}
    page.execute_script("localStorage.setItem('jaxstation.chats', arguments[0])", json.dumps([chat]))
    reload(page)
    blocks = page.find_elements(By.CSS_SELECTOR, ".msg .code pre code")
    assert blocks[0].text == CODE.rstrip("\n") and blocks[1].text == "plain <i>x</i>"
    kinds = [(e.get_attribute("class"), e.text) for e in blocks[0].find_elements(By.CSS_SELECTOR, "span")]
    assert kinds == [("tok-keyword", "def"), ("tok-function", "square"), ("tok-keyword", "return"),
                     ("tok-comment", '# "<b>"')]
    assert not blocks[1].find_elements(By.CSS_SELECTOR, "span") and no_active_content(page, "#messages")
    origin = page.current_url.rstrip("/")
    page.execute_cdp_cmd("Browser.grantPermissions", {"origin": origin, "permissions": [
        "clipboardReadWrite", "clipboardSanitizedWrite"]})
    copies = page.find_elements(By.CSS_SELECTOR, ".msg .code .copy")
    copies[0].click()
    wait(page, lambda d: copies[0].text == "Copied", "the copy button did not say it copied")
    assert clipboard(page) == CODE.rstrip("\n")
    page.execute_script("Object.defineProperty(navigator, 'clipboard', {value: undefined})")  # plain HTTP elsewhere
    copies[1].click()
    wait(page, lambda d: copies[1].text == "Copied", "the copy command did not copy")
    reload(page)
    assert clipboard(page) == "plain <i>x</i>"


def clipboard(driver: WebDriver) -> str:
    return driver.execute_async_script("navigator.clipboard.readText().then(arguments[0], (e) => arguments[0]("
                                       "'refused: ' + e))")


def test_the_context_figure_moves_after_a_reply_and_a_turn_too_long_is_stopped(station, page: WebDriver) -> None:
    context = page.find_element(By.ID, "context-text")
    assert context.text == f"0 / {SHAPE['max_seq']} tokens"
    ask(page, "Say hi.", 8)
    finished(page)
    prompt, completion = map(int, re.findall(r"prompt (\d+) · completion (\d+)", answer_meta(page))[0])
    assert context.text == f"{prompt + completion} / {SHAPE['max_seq']} tokens"
    asked = len(sent_to(station[3], "/v1/chat/completions"))
    ask(page, "And now say bye.", SHAPE["max_seq"] - prompt)
    notice = wait(page, lambda d: d.find_element(By.ID, "notice").is_displayed() and d.find_element(By.ID, "notice"),
                  "no notice of a turn that does not fit")
    assert notice.text.startswith("This turn does not fit: its prompt is ") and "context holds 512" in notice.text
    assert len(sent_to(station[3], "/v1/chat/completions")) == asked
    assert len(page.find_elements(By.CSS_SELECTOR, ".msg")) == 2
    assert page.find_element(By.ID, "prompt").get_attribute("value") == "And now say bye."


HAND_OVER = """const [text, name, how] = arguments;
const data = new DataTransfer();
data.items.add(new File([text], name, {type: 'text/plain'}));
if (how === 'paste') {
  document.getElementById('prompt').dispatchEvent(new ClipboardEvent('paste', {clipboardData: data, bubbles: true,
                                                                               cancelable: true}));
} else {
  for (const type of ['dragover', 'drop']) {
    const event = new DragEvent(type, {dataTransfer: data, bubbles: true, cancelable: true});
    document.querySelector('main').dispatchEvent(event);
  }
}"""


def test_dropped_and_pasted_files_reach_the_request_and_binary_ones_are_refused(station, page: WebDriver,
                                                                                tmp_path) -> None:
    note = "The secret word is zebra-quartz.\n```\nfenced\n```"
    page.execute_script(HAND_OVER, note, "notes.md", "drop")
    page.execute_script(HAND_OVER, "print(1)", "snippet.py", "paste")
    wait(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#attachments .chip")) == 2, "no chips for the files")
    chips = page.find_elements(By.CSS_SELECTOR, "#attachments .chip")
    assert [[chip.find_element(By.TAG_NAME, tag).text for tag in ("span", "small")] for chip in chips] == [
        ["notes.md", "47 B"], ["snippet.py", "8 B"]]
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "big.txt").write_text("x" * (300 * 1024))
    page.find_element(By.ID, "attach").send_keys("\n".join(str(tmp_path / n) for n in ("logo.png", "latin1.txt",
                                                                                      "big.txt")))
    wait(page, lambda d: "big.txt" in d.find_element(By.ID, "notice").text, "no refusal of the big file")
    refusals = page.find_element(By.ID, "notice").text
    assert "logo.png was not attached: it is not text (it holds NUL bytes)." in refusals
    assert "latin1.txt was not attached: it is not text (not valid UTF-8)." in refusals
    assert "big.txt was not attached: it is 300.0 KiB, over the 256.0 KiB a file may be." in refusals
    assert len(page.find_elements(By.CSS_SELECTOR, "#attachments .chip")) == 2
    ask(page, "What is the secret word?", 8)
    finished(page)
    sent = sent_to(station[3], "/v1/chat/completions")[-1]["messages"][-1]["content"]
    assert sent == f"What is the secret word?\n\nnotes.md:\n````md\n{note}\n````\n\nsnippet.py:\n```py\nprint(1)\n```"
    assert [e.text for e in page.find_elements(By.CSS_SELECTOR, ".msg.user .chip span")] == ["notes.md", "snippet.py"]
    assert not page.find_elements(By.CSS_SELECTOR, "#attachments .chip")


def colours(driver: WebDriver) -> tuple[str, str]:
    return tuple(driver.execute_script("const s = getComputedStyle(document.body); return [s.backgroundColor, "
                                       "getComputedStyle(document.querySelector('main')).color]"))


def test_dark_mode_follows_the_system_and_the_toggle_is_kept(page: WebDriver) -> None:
    light = colours(page)
    assert light == ("rgb(247, 247, 248)", "rgb(31, 35, 40)")
    try:
        page.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme",
                                                                          "value": "dark"}]})
        dark = colours(page)
        assert dark == ("rgb(21, 23, 27)", "rgb(230, 232, 235)")
        toggle = page.find_element(By.ID, "theme")
        assert toggle.text == "Theme: auto"
        toggle.click()
        assert toggle.text == "Theme: dark" and colours(page) == dark
        toggle.click()
        assert toggle.text == "Theme: light" and colours(page) == light  # the toggle beats the system
        reload(page)
        assert page.find_element(By.ID, "theme").text == "Theme: light" and colours(page) == light
    finally:
        page.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})


def busy(driver: WebDriver) -> int:
    return len(driver.find_elements(By.CSS_SELECTOR, "#lanes li[data-state='prefilling'], "
                                                     "#lanes li[data-state='decoding']"))


def stream_until(http, i: int, started: threading.Event, stop: threading.Event) -> None:
    """A streamed completion of many tokens over HTTP, read until `stop`; leaving the stream cancels it. The completion
    samples at temperature 1, so EOS is ignored: a stream that ended early would leave its lane free too soon."""
    body = {"model": NAMES[0], "prompt": f"Count from one to a thousand, one number per line ({i}):",
            "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=str(http.base_url), timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c, \
            c.stream("POST", "/v1/completions", json=body) as reply:
        for _ in reply.iter_lines():
            started.set()
            if stop.is_set():
                return


def test_the_station_panel_shows_the_lanes_busy_then_free(station, page: WebDriver) -> None:
    st, _, http, _ = station
    page.find_element(By.ID, "station-toggle").click()
    wait(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#lanes li")) == SHAPE["lanes"], "no lanes shown")
    assert busy(page) == 0
    started, stop = [threading.Event() for _ in range(4)], threading.Event()
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream_until, http, i, started[i], stop) for i in range(4)]
        try:
            wait(page, lambda d: busy(d) == 4, "the panel did not show four busy lanes")
            assert page.find_element(By.ID, "lanes-summary").text == "4 of 4 busy"
            assert all(e.is_set() for e in started)
        finally:
            stop.set()
        for s in streams:
            s.result(timeout=60)
    wait(page, lambda d: busy(d) == 0, "the panel did not show the lanes free again")
    assert page.find_element(By.ID, "queue").text.startswith("0 waiting")
    status = http.get("/station/status", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert status["status"] == "ready" and len(status["lanes"]) == 4 and status["generated_tokens"] > 0
    assert {lane["state"] for lane in status["lanes"]} <= {"free", "cached"}
    assert len(status["throughput"]["generated"]) == 60
    waves = st.scheduler.waves
    time.sleep(1.5)  # the panel polls each second; the decode thread, idle, runs no turn for it
    assert st.scheduler.waves == waves


# ---- a stand-in for the station's stream: long answers, malformed events --------------------------------------------

FAKE_STREAM = """const [events] = arguments;
const real = window.fetch.bind(window);
window.__reads = 0;
window.fetch = (url, init) => {
  if (!String(url).endsWith('/v1/chat/completions')) return real(url, init);
  const encoder = new TextEncoder();
  let i = 0;
  const body = new ReadableStream({pull(controller) {
    if (i === events.length) return controller.close();
    window.__reads += 1;
    controller.enqueue(encoder.encode(events[i++]));
  }});
  return Promise.resolve(new Response(body, {headers: {'Content-Type': 'text/event-stream'}}));
};"""
WATCH = """window.__errors = [];
addEventListener('error', (e) => window.__errors.push(String(e.message)));
addEventListener('unhandledrejection', (e) => window.__errors.push(String(e.reason)));
window.__removed = 0;
new MutationObserver((records) => {
  for (const record of records) {
    for (const node of record.removedNodes) {
      if (node.nodeType === 1) window.__removed += node.matches('.code') + node.querySelectorAll('.code').length;
    }
  }
  const codes = document.querySelectorAll('.msg.assistant .code');
  if (codes.length >= 2 && !window.__first) window.__first = codes[0];
}).observe(document.getElementById('messages'), {childList: true, subtree: true});"""


def events(pieces: list[str], completion: int) -> list[str]:
    """A chat completion's stream of `pieces`, one event each, then its usage and the end."""
    chunks = [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": completion,
                                            "total_tokens": 7 + completion}})
    return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


def long_answer(tokens: int) -> list[str]:
    """A reply of `tokens` pieces of four characters: paragraphs, each followed by a Python code block."""
    parts, b = [], 0
    while sum(map(len, parts)) < 4 * tokens:
        parts.append(f"Step {b}: the function below squares a number and adds {b} to it.\n\n"
                     f"```python\ndef step_{b}(x):\n    # {b}\n    return x * x + {b}\n```\n\n")
        b += 1
    text = "".join(parts)[:4 * tokens]
    return [text[i:i + 4] for i in range(0, len(text), 4)]


def test_a_long_streamed_answer_draws_each_block_once(page: WebDriver) -> None:
    """4,000 tokens, one network read each, with a code block every 30 or so: no block is drawn again once a later
    one has begun (the first code block stays the same node to the end), the code blocks removed from the page are at
    most one a read (the block still streaming in), and the answer drawn piece by piece is the one drawn whole."""
    pieces = long_answer(4000)
    page.execute_script(FAKE_STREAM, events(pieces, len(pieces)))
    page.execute_script(WATCH)
    ask(page, "Write the steps.", 8)
    wait(page, lambda d: "completion 4000" in answer_meta(d), "the long answer did not finish", timeout=120)
    reads, removed, errors = page.execute_script("return [window.__reads, window.__removed, window.__errors]")
    codes = page.find_elements(By.CSS_SELECTOR, ".msg.assistant .code")
    assert len(pieces) == 4000 and reads == 4002 and len(codes) > 100 and not errors
    assert page.execute_script("return window.__first.isConnected && window.__first === "
                               "document.querySelector('.msg.assistant .code')")
    assert removed <= reads
    answer = page.execute_script("return document.querySelector('.msg.assistant .answer').innerHTML")
    assert answer == rendered(page, "".join(pieces), "whole")


def test_a_malformed_event_shows_a_notice_and_the_answer_goes_on(page: WebDriver) -> None:
    good = events(["Hello", " world."], 2)
    page.execute_script(FAKE_STREAM, ["data: {not json\n\n", good[0], "data: null\n\n", 'data: {"choices": 5}\n\n',
                                      *good[1:]])
    page.execute_script(WATCH)
    ask(page, "Say hello.", 8)
    finished(page)
    assert page.find_element(By.ID, "notice").text == (
        "The station sent an event this page could not read; the answer goes on without it.")
    assert page.find_element(By.CSS_SELECTOR, ".msg.assistant .answer").text == "Hello world."
    assert page.execute_script("return window.__errors") == []


def test_a_file_that_is_no_export_shows_a_notice(page: WebDriver, tmp_path) -> None:
    page.execute_script(WATCH)
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "empty.json").write_text(json.dumps([{"title": "no messages"}]))
    page.find_element(By.ID, "import").send_keys(str(tmp_path / "bad.json"))
    notice = wait(page, lambda d: d.find_element(By.ID, "notice").is_displayed() and d.find_element(By.ID, "notice"),
                  "no notice of a file that is not JSON")
    assert notice.text.startswith("bad.json was not imported: it is not JSON (")
    page.find_element(By.ID, "import").send_keys(str(tmp_path / "empty.json"))
    wait(page, lambda d: "empty.json" in d.find_element(By.ID, "notice").text, "no notice of an empty export")
    assert page.find_element(By.ID, "notice").text == "empty.json was not imported: it holds no conversations."
    assert [e.text for e in page.find_elements(By.CSS_SELECTOR, "#chats li .title")] == ["New chat"]
    assert page.execute_script("return window.__errors") == []


FILL_STORAGE = """let i = 0;
for (let size = 1 << 20; size >= 1; ) {
  try {
    localStorage.setItem('filler' + i, 'x'.repeat(size));
    i += 1;
  } catch {
    size >>= 1;
  }
}"""


def test_a_full_local_storage_shows_a_notice_and_the_answer_still_streams(page: WebDriver) -> None:
    page.execute_script(WATCH)
    page.execute_script(FILL_STORAGE)
    ask(page, "Say hi.", 8)
    finished(page)
    assert page.find_element(By.ID, "notice").text == (
        "This browser's storage is full: what the page keeps (conversations, settings) is not saved. Delete or export "
        "conversations to make room.")
    assert [m.get_attribute("class") for m in page.find_elements(By.CSS_SELECTOR, ".msg")] == [
        "msg user", "msg assistant"]
    assert page.find_element(By.CSS_SELECTOR, ".msg.assistant .answer").text.strip()
    assert page.find_element(By.CSS_SELECTOR, "#chats li.current .title").text == "Say hi."
    assert page.execute_script("return window.__errors") == []
