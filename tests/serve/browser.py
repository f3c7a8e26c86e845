"""The chat page in a real browser: headless Chromium (Debian's chromium and
chromium-driver) through selenium loads `/`, enters the API key, sends a
message at temperature 0, and the streamed answer appears on the page,
equal to `te generate --chat`'s greedy answer; a second, long answer is
stopped with the Stop button. Saves a screenshot.

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
for arg in ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1100,800"]:
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
    answer = driver.find_element(By.CSS_SELECTOR, ".msg.assistant").get_attribute("textContent")
    status = driver.find_element(By.ID, "status").text
    expected = te_chat(QUESTION, MAX_TOKENS)
    assert answer == expected, f"page answer {answer!r} != te generate --chat {expected!r}"
    assert status.startswith(("done", "stopped at the token limit")), status
    assert driver.find_element(By.CSS_SELECTOR, ".msg.user").text == QUESTION
    driver.save_screenshot(SHOT)
    print(f"ok chat page answer streamed: {answer!r}; screenshot {SHOT}")

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
finally:
    driver.quit()
