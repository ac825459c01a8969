"""The console in a real browser (docs/console.md): Debian's chromium, headless, driven by Selenium
through the system chromedriver (never a downloaded one). Sign in, see three providers, fail one with
its /admin/health switch and watch it turn unhealthy in place, create a key and use it over plain HTTP,
see its spend and requests appear, revoke it and see the next request refused. A screenshot of every
page goes to tests/artifacts/ (ignored by git), at 1280x800 and at a phone's width.

Skips, saying why, where chromium, chromedriver or selenium is missing (`make browser` installs them)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import candidate, envelope, wait_until
from tests.integration.test_console_keys import PRICES
from tests.integration.test_console_security import OPS, TOKENS, call

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
REFRESH_S = 2.0  # the console's refresh interval (gateway/admin/console/app.py REFRESH_MS)

missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # the test extra not installed
    missing.append("the selenium package")
pytestmark = pytest.mark.skipif(bool(missing), reason=f"the console's browser tests need {', '.join(missing)} "
                                                      "(make browser installs Debian's chromium and chromium-driver)")


@pytest.fixture
def browser(tmp_path) -> Iterator[webdriver.Chrome]:
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must never fetch a browser or a driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1280,800", f"--user-data-dir={tmp_path / 'profile'}", "--no-first-run"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_window_size(1280, 800)
    yield driver
    driver.quit()


def screenshot(driver: webdriver.Chrome, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"console-{name}.png"
    driver.save_screenshot(str(path))
    return path


def health_of(driver: webdriver.Chrome, provider: str) -> str:
    cells = driver.find_elements(By.CSS_SELECTOR, f'tr[data-provider="{provider}"] [data-health]')
    return cells[0].get_attribute("data-health") if cells else ""


def chat(gateway, key: str) -> int:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]})
    return call(gateway.port, "POST", "/v1/chat/completions", body,
                {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}).status


def test_the_console_in_a_browser_from_sign_in_to_a_revoked_key(browser, gateway_factory, mock_provider):
    names = ("provider-a", "provider-b", "provider-c")
    mocks = {name: mock_provider(name) for name in names}
    check = {"type": "http", "path": "/health", "interval": "200ms", "timeout": "1s", "healthy_threshold": 1,
             "unhealthy_threshold": 1}
    gateway = gateway_factory(
        {name: [mocks[name].address] for name in names},
        envelope([candidate("m", "provider-a", 0), candidate("m", "provider-b", 0), candidate("m", "provider-c", 1)]),
        cluster_options={"health_check": check},
        extra={"admin": {"tokens": TOKENS}, "auth": {}, "pricing": {"overrides": PRICES},
               "quota": {"backend": {"kind": "embedded"}, "rules": [
                   {"name": "team-a", "match": {"tenant": "team-a"}, "budgets": [{"window": "1h", "tokens": 1000000}]}]}})
    console = f"http://127.0.0.1:{gateway.admin_port}/console"
    wait = WebDriverWait(browser, 10)

    browser.get(console)
    screenshot(browser, "sign-in")
    browser.find_element(By.ID, "token").send_keys("not-the-token")
    browser.find_element(By.ID, "sign-in").click()
    # the answer comes after the failed sign-in is written to the audit log: wait for it
    assert "invalid admin token" in wait.until(expected_conditions.presence_of_element_located((By.ID, "problem"))).text
    browser.find_element(By.ID, "token").send_keys(OPS)
    browser.find_element(By.ID, "sign-in").click()
    wait.until(expected_conditions.presence_of_element_located((By.ID, "live")))
    assert browser.get_cookie("console_session")["httpOnly"] is True
    assert browser.execute_script("return document.cookie") == ""  # no script reads the session

    wait.until(lambda d: all(health_of(d, name) == "healthy" for name in names))
    assert [row.get_attribute("data-provider") for row in browser.find_elements(By.CSS_SELECTOR, "tr[data-provider]")] \
        == list(names)
    screenshot(browser, "providers")
    call(mocks["provider-c"].port, "POST", "/admin/health", json.dumps({"status": 503}),
         {"Content-Type": "application/json"})
    failed_at = time.monotonic()
    WebDriverWait(browser, REFRESH_S + 3).until(lambda d: health_of(d, "provider-c") == "unhealthy")
    # the health check's verdict (<= 0.4 s at a 200 ms interval) plus one refresh, with room for a busy machine
    assert time.monotonic() - failed_at <= REFRESH_S + 3
    assert health_of(browser, "provider-a") == "healthy"  # refreshed in place, not reloaded: same page
    screenshot(browser, "providers-one-unhealthy")

    browser.find_element(By.ID, "nav-endpoints").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "tr[data-endpoint] [data-health='unhealthy']"))
    screenshot(browser, "endpoints")

    browser.find_element(By.ID, "nav-keys").click()
    browser.find_element(By.ID, "tenant").send_keys("team-a")
    browser.find_element(By.ID, "alias").send_keys("browser")
    browser.find_element(By.ID, "create").click()
    key = wait.until(lambda d: d.find_element(By.ID, "new-key")).text
    assert key.startswith("gg-")
    screenshot(browser, "key-created")
    wait_until(lambda: chat(gateway, key) == 200, "the key made in the browser to serve", 10)
    for _ in range(5):
        assert chat(gateway, key) == 200

    browser.get(f"{console}/keys")  # the secret is gone from the page for good
    assert key not in browser.page_source
    wait.until(lambda d: "$0 over" not in d.find_element(By.CSS_SELECTOR, "#spend-all svg").text)
    screenshot(browser, "keys")

    browser.find_element(By.ID, "nav-requests").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "tr[data-request-id]"))
    assert "team-a" in browser.find_element(By.CSS_SELECTOR, "table.requests").text
    screenshot(browser, "requests")

    browser.find_element(By.ID, "nav-keys").click()
    revoke = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "button[data-action='revoke']"))
    revoke.click()
    wait.until(expected_conditions.alert_is_present()).accept()  # the page asks before revoking
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "[data-status='revoked']"))
    wait_until(lambda: chat(gateway, key) == 401, "the revoked key to be refused", 5)

    browser.set_window_size(390, 844)  # a phone
    browser.get(console)
    wait.until(lambda d: health_of(d, "provider-a") == "healthy")
    width = browser.execute_script("return document.documentElement.scrollWidth")
    assert width <= 400  # no sideways scrolling of the page: wide tables scroll in their own box
    screenshot(browser, "providers-phone")
    browser.find_element(By.ID, "sign-out").click()
    wait.until(lambda d: d.find_elements(By.ID, "token"))
