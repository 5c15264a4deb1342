"""cli/page.py and its template: the inspect page, opened from disk in a real headless Chromium for
every attention option, with and without a cache; its views follow the slider, the arrow keys and
the layer and head chosen, as the recorded data says; and a page the disk refuses, which leaves
the earlier one."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from cli.page import write_inspect_page
from data.tokenizer import BPETokenizer
from model.generation import Decoding, stream
from model.recorder import DecodeRecorder
from model.sampling import Sampling
from tests.helpers import (
    ATTENTION,
    BOUNDED,
    ENDLESS,
    assert_one_line_error,
    cache_kind_model,
    disk_full_after,
    run_in_process,
    temp_files,
    tiny_model,
)

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium to open the inspect page in: `apt-get install chromium` "
                             "(Debian, Ubuntu; what .ci/run does as root) or `brew install chromium`")
# The child's fds 3 and 4 are Chromium's --remote-debugging-pipe; a trampoline puts them there.
PIPE_FDS = ("import os, sys; a, b = (os.dup(int(fd)) for fd in sys.argv[1:3]); os.dup2(a, 3); "
            "os.dup2(b, 4); os.set_inheritable(3, True); os.set_inheritable(4, True); "
            "os.execv(sys.argv[3], sys.argv[3:])")


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (JSON messages ending in NUL):
    no driver and no websocket package. Collects the page's console errors and exceptions."""

    def __init__(self):
        to_child, self.to_browser = os.pipe()
        self.from_browser, from_child = os.pipe()
        self.profile = tempfile.mkdtemp()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PIPE_FDS, str(to_child), str(from_child), os.path.realpath(CHROMIUM),
             "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
             f"--user-data-dir={self.profile}", "--window-size=1200,900", "about:blank"],
            pass_fds=(to_child, from_child), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self.buffer, self.next_id, self.errors, self.loaded = b"", 0, [], False
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")

    def call(self, method, **params):
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if getattr(self, "session", None):
            message["sessionId"] = self.session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self.receive()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def receive(self) -> dict:
        while b"\0" not in self.buffer:
            chunk = os.read(self.from_browser, 1 << 16)
            if not chunk:
                raise EOFError("Chromium closed its pipe")
            self.buffer += chunk
        raw, self.buffer = self.buffer.split(b"\0", 1)
        message = json.loads(raw)
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.exceptionThrown":
            self.errors.append(params["exceptionDetails"].get("exception", {}).get("description", params))
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert", "warning"):
            self.errors.append([a.get("value") for a in params["args"]])
        elif method == "Log.entryAdded" and params["entry"]["level"] in ("error", "warning"):
            self.errors.append(params["entry"]["text"])
        elif method == "Page.loadEventFired":
            self.loaded = True
        return message

    def open(self, path) -> None:
        self.loaded, self.errors = False, []
        self.call("Page.navigate", url=f"file://{path}")
        while not self.loaded:
            self.receive()

    def run(self, expression: str):
        """The value of a JavaScript expression in the page."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def press(self, key: str, code: int) -> None:
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=key, windowsVirtualKeyCode=code)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self.to_browser)
        os.close(self.from_browser)
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    browser = Browser()
    yield browser
    browser.close()


# What the page shows: every view's numbers, read back from the DOM.
VIEWS = """JSON.stringify({
  step: +document.getElementById("step").value,
  strips: [...document.querySelectorAll("#cache .strip")].map((s) =>
    [...s.children].map((c) => +c.dataset.seq)),
  written: [...document.querySelectorAll("#cache .strip")].map((s) =>
    [...s.children].flatMap((c, i) => (c.classList.contains("written") ? [i] : []))),
  attention: [...document.getElementById("attn-row").children].map((c) => +c.dataset.weight),
  text: [...document.querySelectorAll("#text span")].filter((s) =>
    getComputedStyle(s).display !== "none").length,
  errors: document.getElementById("errors").textContent,
  cache: document.getElementById("cache-note").textContent,
})"""


def check_views(browser, record, step: int, layer: int, head: int) -> None:
    """The views show step `step` of `record` for this layer and head, as its data says."""
    shown = json.loads(browser.run(VIEWS))
    data = record["steps"][step]
    assert shown["step"] == step and shown["text"] == record["prompt_len"] + step + 1
    cache = record["cache"]
    group = cache["groups"] if cache else None
    g = record["model"]["layer_group"][layer] if cache else 0
    slots = group[g]["slots"] if cache else len(data["groups"][0]["seq"])
    weights = data["weights"][layer][head]
    assert shown["attention"] == weights + [0] * (slots - len(weights))
    if cache is None:
        assert shown["strips"] == [] and "No cache" in shown["cache"]
        return
    for kind, strip, written, recorded in zip(group, shown["strips"], shown["written"], data["groups"]):
        assert strip == recorded["seq"] + [-1] * (kind["slots"] - len(recorded["seq"]))
        assert written == recorded["written"]
    assert ("int8 error" in shown["errors"]) == cache["quantized"]


def record_of(model, prompt, new=12, **kw) -> dict:
    with DecodeRecorder(model, prompt) as recorder:
        for _ in recorder.watch(stream(model, torch.tensor([prompt]), Sampling(new, 0.8), Decoding(**kw))):
            pass
    return recorder.record()


MODELS = ATTENTION | ENDLESS | BOUNDED
KINDS = [dict(kv_cache=True), dict(kv_cache=True, kv_dtype="int8"), dict(kv_cache=False)]


@needs_chromium
@pytest.mark.parametrize("name", MODELS)
def test_the_page_opens_and_follows_the_slider_for_every_attention_option(browser, name, tmp_path):
    """A prompt past block_size (24): refills and ring wraps on the page. Keys move the step; the
    layer and head change what the attention view draws. The options take turns at the cache
    kinds (float32, int8, none), so that each kind meets several."""
    model = cache_kind_model(MODELS[name])
    torch.manual_seed(0)
    prompt = torch.randint(0, 37, (28,)).tolist()
    record = record_of(model, prompt, **KINDS[list(MODELS).index(name) % len(KINDS)])
    path = tmp_path / "page.html"
    write_inspect_page(path, record, [chr(65 + t % 26) + "<\n"[t % 2] for t in record["tokens"]])
    browser.open(path)
    assert browser.errors == []
    check_views(browser, record, 0, 0, 0)
    browser.press("ArrowRight", 39)
    browser.press("ArrowRight", 39)
    browser.press("ArrowLeft", 37)
    check_views(browser, record, 1, 0, 0)
    layer, head = model.config.n_layer - 1, model.config.n_head - 1
    browser.run(f"""for (const [id, v] of [["layer", {layer}], ["head", {head}], ["step", 11]]) {{
        const e = document.getElementById(id); e.value = v; e.dispatchEvent(new Event("input")); }}""")
    check_views(browser, record, 11, layer, head)
    assert browser.errors == []


@needs_chromium
def test_a_bpe_page_with_cut_characters_and_the_cli(browser, tiny_ckpt, tmp_path):
    """GPT-2's BPE pieces (’ cut into two tokens shows as U+FFFD) and a char checkpoint through
    generate.py: pages open without errors, with no address outside the file."""
    model = tiny_model(vocab_size=50257)
    tokenizer = BPETokenizer()
    prompt = tokenizer.encode("A ’quoted’ </script> café")
    record = record_of(model, prompt, new=6)
    write_inspect_page(tmp_path / "bpe.html", record,
                       [tokenizer.token_bytes(t).decode("utf-8", errors="replace") for t in record["tokens"]])
    page = tmp_path / "cli.html"
    result = run_in_process("generate.py", f"ckpt={tiny_ckpt}", "prompt=ROMEO:", "max_new_tokens=30",
                            f"inspect={page}")
    assert result.returncode == 0, result.stderr
    assert f"inspect page saved to {page} (30 steps" in result.stdout
    for path in (tmp_path / "bpe.html", page):
        text = path.read_text()
        assert "://" not in text and " src=" not in text and "<link" not in text  # nothing to fetch
        browser.open(path)
        assert browser.errors == []
    check_views(browser, json.loads(browser.run("JSON.stringify(data)")), 0, 0, 0)


def test_a_page_the_disk_refuses_names_inspect_and_keeps_the_earlier_page(tiny_ckpt, tmp_path):
    """generate.py inspect=<file> where writes fail part-way through the page (past 8 kB; the template
    alone is 11 kB): one line naming the option and the file, the earlier page as it was, no temp file."""
    page, earlier = tmp_path / "page.html", b"<html>the earlier page</html>"
    page.write_bytes(earlier)
    with disk_full_after(8192):
        result = run_in_process("generate.py", f"ckpt={tiny_ckpt}", "prompt=ROMEO:", "max_new_tokens=4",
                                f"inspect={page}")
    assert_one_line_error(result, f"error: inspect: cannot write inspect page {page}: File too large; the "
                                  f"previous one is intact")
    assert page.read_bytes() == earlier and temp_files(tmp_path) == []
