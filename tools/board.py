"""TensorBoard in a real browser, for the browser test and the README's screenshots.

:func:`serve` runs ``tensorboard`` on a free local port for a log folder; :func:`browser`
opens headless Chromium through Selenium with the system's ``chromedriver`` (never a
downloaded one) and raises :class:`NoBrowser`, saying what is missing, where it cannot;
:func:`open_dashboard` loads one dashboard and waits until given words show, reading the
text inside TensorBoard's shadow DOM; :func:`checkboxes` reads the HPARAMS column choosers.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# every text node and every <img>, through the shadow roots of TensorBoard's components
_WALK = """
function walk(node, texts, images) {
  if (node.shadowRoot) walk(node.shadowRoot, texts, images);
  for (const child of node.childNodes) {
    if (child.nodeType === 3) texts.push(child.textContent);
    else {
      if (child.tagName === 'IMG' && child.complete) images.push([child.src, child.naturalWidth]);
      walk(child, texts, images);
    }
  }
}
const texts = [], images = [];
walk(document, texts, images);
return [texts.join(' '), images];
"""


# the label and state of every checkbox (the HPARAMS dashboard's column choosers)
_CHECKBOXES = """
function walk(node, out) {
  if (node.shadowRoot) walk(node.shadowRoot, out);
  for (const child of node.children || []) {
    if (child.tagName === 'PAPER-CHECKBOX') out.push([child.textContent.trim(), !!child.checked]);
    walk(child, out);
  }
}
const out = []; walk(document, out); return out;
"""


class NoBrowser(RuntimeError):
    """No headless browser can be had here; the message says what is missing."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(logdir: Path, timeout: float = 60.0) -> Iterator[str]:
    """``tensorboard --logdir logdir`` on 127.0.0.1 and a free port, up; yields its URL."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--port", str(port),
         "--host", "127.0.0.1", "--load_fast", "false", "--reload_interval", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{url}/data/plugins_listing", timeout=2)
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tensorboard did not start: {process.stderr.read().decode()[-2000:]}") from None
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextlib.contextmanager
def browser(width: int = 1400, height: int = 1000):
    """Headless Chromium driven by Selenium; raises :class:`NoBrowser` when there is none."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as err:
        raise NoBrowser("selenium is not installed (pip install selenium)") from err
    binary = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        raise NoBrowser("no chromium and chromedriver on the PATH (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", f"--window-size={width},{height}"):
        options.add_argument(flag)
    try:
        driver = webdriver.Chrome(service=Service(driver_path), options=options)
    except Exception as err:  # noqa: BLE001 - any failure to start is "no browser here"
        raise NoBrowser(f"chromium would not start: {type(err).__name__}: {str(err)[:300]}") from err
    try:
        yield driver
    finally:
        driver.quit()


def open_dashboard(
    driver, url: str, dashboard: str, words: Sequence[str], images: int = 0, timeout: float = 60.0,
):
    """Load ``url#dashboard`` and wait until every one of ``words`` shows and at least
    ``images`` pictures have loaded; returns ``(text, pictures)``, the page's text and its
    loaded ``[(src, naturalWidth)]``, as they are then or at the timeout."""
    driver.get(f"{url}/#{dashboard}")
    deadline = time.monotonic() + timeout
    while True:
        text, shown = driver.execute_script(_WALK)
        shown = [(src, w) for src, w in shown if w > 0]
        done = all(w in text for w in words) and len(shown) >= images
        if done or time.monotonic() > deadline:
            return text, shown
        time.sleep(0.3)


def checkboxes(driver) -> dict[str, bool]:
    """``{label: checked}`` of the page's checkboxes (in HPARAMS: which columns show)."""
    return {label: state for label, state in driver.execute_script(_CHECKBOXES) if label}
