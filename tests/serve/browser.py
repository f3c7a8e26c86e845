"""The chat page in a real browser: headless Chromium (Debian's chromium and
chromium-driver) through selenium loads `/`, enters the API key, sends a
message at temperature 0, and the streamed answer appears on the page,
equal to `te generate --chat`'s greedy answer, with its speed and time to
first token under it; a second, long answer is stopped with the Stop
button. A reload keeps the conversation; a stored answer with a code block
renders as highlighted code; screenshots at 1200 px (SCREENSHOT) and 400 px
wide (SCREENSHOT with -400 before .png), where the settings stay usable.

usage: browser.py BASE_URL API_KEY TE_BINARY MODEL SCREENSHOT.png
"""

import json
import re
import subprocess
import sys
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

BASE, KEY, TE, MODEL, SHOT = sys.argv[1:6]
QUESTION = "What is the capital of France?"
MAX_TOKENS = 24


def te_chat(prompt, max_new):
    out = subprocess.run([TE, "generate", "--model", MODEL, "--json", "--chat", "--max-new-tokens", str(max_new),
                          "--prompt", prompt], capture_output=True, text=True, check=True)
    return re.sub(r"<\|[a-z_]+\|>", "", json.loads(out.stdout)["text"])


def chromium_path(name):
    for path in [f"/usr/bin/{name}", f"/usr/lib/chromium/{name}"]:
        try:
            open(path).close()
            return path
        except OSError:
            pass
    raise SystemExit(f"{name} not found (apt-get install chromium chromium-driver)")


options = webdriver.ChromeOptions()
options.binary_location = chromium_path("chromium")
for arg in ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,800"]:
    options.add_argument(arg)
driver = webdriver.Chrome(service=Service(executable_path=chromium_path("chromedriver")), options=options)
wait = WebDriverWait(driver, 120)
try:
    driver.get(BASE + "/")
    assert driver.title == "te-rs chat", driver.title
    # The server has an API key: the page cannot list the model until it is given.
    key = driver.find_element(By.ID, "api-key")
    key.send_keys(KEY)
    driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
    wait.until(lambda d: d.find_element(By.ID, "model").text == MODEL)
    # Temperature 0 (greedy) and a short answer.
    driver.execute_script(
        "const t = document.getElementById('temperature'); t.value = '0'; t.dispatchEvent(new Event('input'));"
        f"const m = document.getElementById('max-tokens'); m.value = '{MAX_TOKENS}';")
    box = driver.find_element(By.ID, "input")
    box.send_keys(QUESTION)
    box.send_keys(Keys.ENTER)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    # The answer streams in: text appears while the generation still runs.
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant").text.strip())
    wait.until(lambda d: d.find_element(By.ID, "send").is_enabled())
    # The markdown source of the rendered answer.
    answer = driver.find_element(By.CSS_SELECTOR, ".msg.assistant").get_attribute("data-raw")
    status = driver.find_element(By.ID, "status").text
    expected = te_chat(QUESTION, MAX_TOKENS)
    assert answer == expected, f"page answer {answer!r} != te generate --chat {expected!r}"
    assert status.startswith(("done", "stopped at the token limit")), status
    assert driver.find_element(By.CSS_SELECTOR, ".msg.user").text == QUESTION
    meta = driver.find_element(By.CSS_SELECTOR, ".meta").text
    assert re.fullmatch(r"\d+ tokens · [\d.]+ tokens/s · TTFT [\d.]+ s", meta), meta
    print(f"ok chat page answer streamed: {answer!r}; {meta}")

    # A second turn of the same conversation, stopped midway.
    driver.execute_script("document.getElementById('max-tokens').value = '2000';")
    box.send_keys("Now write a very long story about Paris.")
    box.send_keys(Keys.ENTER)
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2)
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[1].text) > 10)
    driver.find_element(By.ID, "stop").click()
    wait.until(lambda d: d.find_element(By.ID, "status").text == "stopped")
    stopped = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[1].text
    time.sleep(0.5)
    assert driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[1].text == stopped, "nothing after Stop"
    assert driver.find_element(By.ID, "send").is_enabled()
    print(f"ok stop button ended the second answer after {len(stopped)} characters")

    # A reload keeps the conversation (and the API key).
    raws = lambda d: [m.get_attribute("data-raw") for m in d.find_elements(By.CSS_SELECTOR, ".msg.assistant")]
    before = raws(driver)
    driver.refresh()
    wait.until(lambda d: d.find_element(By.ID, "model").text == MODEL)
    assert [m.text for m in driver.find_elements(By.CSS_SELECTOR, ".msg.user")][0] == QUESTION
    assert raws(driver) == before, f"{raws(driver)} != {before}"
    print("ok a reload keeps the conversation")

    # An answer with a code block renders as highlighted code.
    code_answer = "Here it is:\n\n```python\ndef add(a, b):\n    return a + b  # the sum\n```\n\nCall **add**."
    driver.execute_script(
        "localStorage.setItem('te-chat-conversation', JSON.stringify(arguments[0]));",
        [{"role": "user", "content": "Write a Python function that adds two numbers."},
         {"role": "assistant", "content": code_answer, "meta": "21 tokens · 30.0 tokens/s · TTFT 0.10 s"}])
    driver.refresh()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant pre code"))
    code = driver.find_element(By.CSS_SELECTOR, ".msg.assistant pre code")
    assert code.text == "def add(a, b):\n    return a + b  # the sum", repr(code.text)
    kinds = {e.get_attribute("class") for e in code.find_elements(By.CSS_SELECTOR, "span")}
    assert {"tok-kw", "tok-com"} <= kinds, kinds
    assert driver.find_element(By.CSS_SELECTOR, ".msg.assistant strong").text == "add"
    assert driver.find_element(By.CSS_SELECTOR, "link[rel=icon]").get_attribute("href").startswith("data:image/svg")
    driver.save_screenshot(SHOT)
    print(f"ok a code answer renders highlighted; screenshot {SHOT}")

    # Phone width: the settings are on screen and usable.
    driver.set_window_size(400, 800)
    time.sleep(0.3)
    temperature = driver.find_element(By.ID, "temperature")
    assert temperature.is_displayed()
    box = temperature.rect
    assert box["x"] >= 0 and box["x"] + box["width"] <= 400, box
    narrow = SHOT[:-4] + "-400.png"
    driver.save_screenshot(narrow)
    print(f"ok the settings are usable at 400 px; screenshot {narrow}")
finally:
    driver.quit()
