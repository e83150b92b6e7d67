"""JupyterLab in a real browser, through `tunnel up`, on the "Python 3 (GPU magics)" kernel.

Debian's chromium, driven by Playwright, opens the URL `tunnel up` prints (a real sshd, a real
Jupyter server behind the forward), creates a notebook from the launcher and types and runs
cells the way a user does: Python, %gpuhelp, a cell mixing Python and magic lines, input() in a
plain and in a mixed cell (answered in the browser's input box) and the live
`%gpumem --watch` gauge. Every step leaves a screenshot (the directory is printed).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from playwright.sync_api import expect
from tunnel_harness import EXIT, port_of, token_of

KERNEL = "Python 3 (GPU magics)"
# Generous (a run takes about 20 s): on a 2-core CI machine the browser, Jupyter, gpukernel
# and ipykernel share the cores.
LOAD_MS = 90_000
CELL_MS = 60_000
# Without an NVIDIA driver (CI), %gpumem says so; with one it shows tables. Both name the
# Python kernel it inspected.
NO_GPU = not Path("/proc/driver/nvidia/version").exists()
NO_DRIVER = "No NVIDIA GPU is visible here"
GAUGE_NO_DRIVER = "GPU gauge: no NVIDIA driver found"


class Lab:
    """One notebook in JupyterLab, driven through the page like a user would."""

    def __init__(self, page, shots: Path):
        self.page = page
        self.shots = shots
        self.n = 0
        self.notebook = page.locator(".jp-NotebookPanel")

    @contextlib.contextmanager
    def step(self, name: str):
        """A screenshot after the step; on failure one marked FAILED, then the error."""
        self.n += 1
        label = f"{self.n:02d}-{name}"
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self.page.screenshot(path=str(self.shots / f"{label}-FAILED.png"))
            print(f"step {label} failed; screenshots in {self.shots}")
            raise
        self.page.screenshot(path=str(self.shots / f"{label}.png"))

    def cell(self, i: int):
        return self.notebook.locator(".jp-Notebook .jp-CodeCell").nth(i)

    def wait_kernel_idle(self, timeout: float = CELL_MS):
        """The kernel named in the toolbar, and idle in the status bar (the toolbar's circle
        reads idle even before a kernel is attached)."""
        self.notebook.locator(f'.jp-Toolbar-kernelName[aria-label="{KERNEL}"]').wait_for(
            timeout=timeout)
        status = self.page.locator(
            '#jp-main-statusbar .jp-StatusBar-TextItem[title^="Change kernel"]')
        expect(status).to_have_text(f"{KERNEL} | Idle", timeout=timeout)

    def type_into(self, i: int, code: str):
        """Puts code into cell i's editor (as typed text, bypassing auto-closed brackets)."""
        editor = self.cell(i).locator(".cm-content")
        editor.click()
        self.page.keyboard.press("Control+a")
        self.page.keyboard.insert_text(code)
        lines = editor.locator(".cm-line").all_inner_texts()
        assert "\n".join(lines) == code, lines

    def run(self, i: int, code: str):
        """Types code into cell i and runs it with Shift+Enter (which adds cell i+1)."""
        self.type_into(i, code)
        self.page.keyboard.press("Shift+Enter")
        expect(self.cell(i + 1)).to_be_visible(timeout=CELL_MS)

    def wait_done(self, i: int, count: int):
        """Cell i shows execution count `count` and the kernel is idle again."""
        expect(self.cell(i).locator(".jp-InputPrompt")).to_have_text(f"[{count}]:",
                                                                     timeout=CELL_MS)
        self.wait_kernel_idle()

    def outputs(self, i: int):
        return self.cell(i).locator(".jp-OutputArea-child")

    def output_texts(self, i: int) -> list[str]:
        """The text of each output of cell i, whitespace runs collapsed to one space."""
        texts = self.cell(i).locator(".jp-OutputArea-output").all_inner_texts()
        return [" ".join(s.split()) for s in texts]

    def answer_input(self, i: int, prompt: str, answer: str):
        """The input box input() opens under cell i: check its prompt, type, press Enter."""
        box = self.cell(i).locator(".jp-Stdin")
        expect(box.locator(".jp-Stdin-prompt")).to_have_text(prompt, timeout=CELL_MS)
        field = box.locator("input.jp-Stdin-input")
        field.click()
        field.fill(answer)
        self.page.screenshot(path=str(self.shots / f"{self.n:02d}-input-box.png"))
        field.press("Enter")
        # The box fades out once answered; JupyterLab echoes prompt and answer as stdout.
        expect(self.cell(i).locator(".jp-OutputArea-stdin-item")).to_have_count(0,
                                                                                timeout=CELL_MS)


# Watches cell i's output area: how many outputs it ever holds, how many distinct output
# elements appear, how often one is re-rendered in place (JupyterLab rewrites the rendered
# element's content: a record on it that removes the old nodes), and the texts shown.
WATCH_JS = """
(area) => {
  const g = {maxOutputs: 0, elements: [], rerenders: 0, texts: []};
  new MutationObserver((records) => {
    for (const r of records) {
      if (r.target.closest && r.target.closest('.jp-OutputArea-output') &&
          r.removedNodes.length > 0) g.rerenders += 1;
    }
    const outs = area.querySelectorAll(':scope > .jp-OutputArea-child').length;
    g.maxOutputs = Math.max(g.maxOutputs, outs);
    const el = area.querySelector('.jp-OutputArea-output');
    if (!el) return;
    if (!g.elements.includes(el)) g.elements.push(el);
    const text = el.innerText;
    if (g.texts[g.texts.length - 1] !== text) g.texts.push(text);
  }).observe(area, {childList: true, subtree: true, characterData: true});
  window.__gauge = g;
}
"""
GAUGE_STATE_JS = """() => { const g = window.__gauge;
  return {maxOutputs: g.maxOutputs, elements: g.elements.length, rerenders: g.rerenders,
          texts: g.texts}; }"""


def test_gpu_python_notebook_in_jupyterlab(tunnel, tmp_path, browser, screenshots, remote_init):
    started = time.monotonic()
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    t = tunnel("--dir", str(notebooks), "--init", remote_init)
    url = t.wait_url(timeout=120)
    port, token = port_of(url), token_of(url)

    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.set_default_timeout(CELL_MS)
    lab = Lab(page, screenshots)
    console_errors: list[str] = []
    page.on("pageerror", lambda e: console_errors.append(str(e)))

    with lab.step("launcher"):
        # ?reset: start from the default layout, whatever workspace was saved.
        page.goto(f"http://127.0.0.1:{port}/lab?reset&token={token}", timeout=LOAD_MS)
        card = page.locator(f'.jp-LauncherCard[data-category="Notebook"][title="{KERNEL}"]')
        card.wait_for(timeout=LOAD_MS)

    with lab.step("new-notebook"):
        card.click()
        lab.notebook.wait_for(timeout=LOAD_MS)
        lab.wait_kernel_idle(timeout=LOAD_MS)

    with lab.step("python-cell"):
        lab.run(0, "import os\nprint(6 * 7, os.getpid())")
        lab.wait_done(0, 1)
        expect(lab.outputs(0)).to_have_count(1)
        answer, kernel_pid = lab.output_texts(0)[0].split()
        assert answer == "42", lab.output_texts(0)

    with lab.step("gpuhelp"):
        lab.run(1, "%gpuhelp")
        lab.wait_done(1, 2)
        expect(lab.outputs(1)).to_have_count(1)
        # The HTML bundle renders as a real table (not its text/plain fallback).
        table = lab.cell(1).locator(".jp-RenderedHTMLCommon table")
        expect(table).to_be_visible()
        assert table.locator("th").all_inner_texts() == ["magic", "what it does"]
        magics = table.locator("tbody tr td:first-child code").all_inner_texts()
        assert {"%gpuhelp", "%gpumem", "%emptycache", "%maxbatch"} <= set(magics), magics

    with lab.step("mixed-cell"):
        lab.run(2, "x = 6*7\n%gpumem\nprint(x)")
        lab.wait_done(2, 3)
        expect(lab.outputs(2)).to_have_count(2)
        gpumem, printed = lab.output_texts(2)
        assert f"Python kernel (pid {kernel_pid})" in gpumem, gpumem
        if NO_GPU:
            assert NO_DRIVER in gpumem, gpumem
        assert printed == "42", printed

    with lab.step("input-plain-cell"):
        lab.run(3, "name = input('name? ')\nprint('hello', name)")
        lab.answer_input(3, "name? ", "Ada")
        lab.wait_done(3, 4)
        texts = lab.output_texts(3)
        assert texts == ["name? Ada", "hello Ada"], texts

    with lab.step("input-mixed-cell"):
        lab.run(4, "a = input('first? ')\n%gpumem\nprint('got', a)")
        lab.answer_input(4, "first? ", "zed")
        lab.wait_done(4, 5)
        texts = lab.output_texts(4)
        assert len(texts) == 3, texts
        assert texts[0] == "first? zed", texts
        assert f"Python kernel (pid {kernel_pid})" in texts[1], texts
        assert texts[2] == "got zed", texts

    with lab.step("gpumem-watch"):
        area = lab.cell(5).locator(".jp-OutputArea")
        area.evaluate(WATCH_JS)
        lab.run(5, "%gpumem --watch 0.5 --count 4")
        lab.wait_done(5, 6)
        # In the Python kernel the gauge runs in the background: the cell is done at once and
        # the display is updated 3 more times, 0.5 s apart, in the same output; each sample
        # says which it is ("sample 2 of 4"), so every update shows a new text.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and page.evaluate(GAUGE_STATE_JS)["rerenders"] < 3:
            time.sleep(0.2)
        time.sleep(1.5)  # and nothing more after --count 4
        gauge = page.evaluate(GAUGE_STATE_JS)
        assert gauge["maxOutputs"] == 1, gauge  # never a second output appended
        assert gauge["elements"] == 1, gauge  # one rendered element throughout ...
        assert gauge["rerenders"] == 3, gauge  # ... shown once and updated 3 times in place
        expect(lab.outputs(5)).to_have_count(1)
        assert len(gauge["texts"]) == 4, gauge  # 4 distinct texts: samples 1 to 4 of 4
        assert "sample 4 of 4" in gauge["texts"][-1], gauge
        if NO_GPU:  # every sample says why there is nothing to show yet
            assert all(s.startswith(GAUGE_NO_DRIVER) for s in gauge["texts"]), gauge

    with lab.step("saved"):
        lab.notebook.locator('jp-button[data-command="docmanager:save"]').click()
        # An untitled notebook is offered a name on its first save.
        dialog = page.locator(".jp-Dialog")
        expect(dialog.locator(".jp-Dialog-header")).to_have_text("Rename file")
        dialog.locator("input.jp-mod-styled").first.fill("browser-test.ipynb")
        dialog.locator("button.jp-mod-accept").click()
        expect(page.locator(".jp-mod-current .lm-TabBar-tabLabel")).to_have_text(
            "browser-test.ipynb")
        saved = notebooks / "browser-test.ipynb"
        deadline = time.monotonic() + 30
        nb = None
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                nb = json.loads(saved.read_text())
                if len(nb["cells"]) >= 6 and nb["cells"][5]["outputs"]:
                    break
            time.sleep(0.2)
        assert nb is not None and len(nb["cells"]) >= 6, f"{saved} was not saved: {nb}"
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert nb["metadata"]["kernelspec"]["display_name"] == KERNEL
        assert [c["execution_count"] for c in code[:6]] == [1, 2, 3, 4, 5, 6]
        watch = code[5]["outputs"]
        assert [o["output_type"] for o in watch] == ["display_data"], watch

    assert not console_errors, console_errors
    page.close()
    assert t.interrupt_and_wait() == EXIT["ok"], t.stderr
    print(f"browser test took {time.monotonic() - started:.1f}s")
