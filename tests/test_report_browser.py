"""`report.html` as a researcher opens it: Debian's headless Chromium in a 1,280 x 800 window.

The page is loaded from a copy with one script added that measures it once loaded (page and table widths, every
image's natural width, the text fully inside the first screen) and leaves the figures in the DOM that
``chromium --dump-dom`` prints; no browser driver or download is needed. Without Chromium (scripts/test installs it
with apt-get where it can) the tests skip and say so.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from analysis.report import build_report
from benchmarks.synthetic_store import synthetic_store
from conftest import new_store

pytestmark = pytest.mark.xdist_group("report")

WIDTH, HEIGHT = 1280, 800

_MEASURE = """<script>
window.addEventListener("load", () => {
  const clipped = (node, r) => {
    for (let el = node.parentElement; el && el !== document.body; el = el.parentElement) {
      if (getComputedStyle(el).overflowX === "visible") continue;
      const box = el.getBoundingClientRect();
      if (r.left < box.left - 0.5 || r.right > box.right + 0.5) return true;
    }
    return false;
  };
  const firstScreen = [];
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walk.nextNode(); node; node = walk.nextNode()) {
    const range = document.createRange();
    range.selectNodeContents(node);
    const rects = [...range.getClientRects()].filter(r => r.width > 0 && r.height > 0);
    if (rects.length && rects.every(r => r.bottom <= innerHeight && r.left >= 0 && r.right <= innerWidth
                                         && !clipped(node, r))) firstScreen.push(node.textContent);
  }
  const boxes = [...document.querySelectorAll("div.wide")];
  const out = {
    innerWidth: innerWidth,
    scrollWidth: document.documentElement.scrollWidth,
    images: [...document.images].map(img => img.naturalWidth),
    firstTable: boxes.length ? [boxes[0].scrollWidth, boxes[0].clientWidth] : null,
    firstScreen: firstScreen,
  };
  const holder = document.createElement("template");
  holder.id = "measured";
  holder.setAttribute("data-json", JSON.stringify(out));
  document.body.appendChild(holder);
});
</script>"""


@pytest.fixture(scope="module")
def chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        pytest.skip("Debian's chromium is not installed here (scripts/test installs it with apt-get where apt is "
                    "available and the user is root)")
    return found


def measure(chromium: str, page: Path, tmp: Path) -> dict:
    """What Chromium sees of ``page`` in a WIDTH x HEIGHT window."""
    probe = tmp / f"measured-{page.parent.name}.html"
    probe.write_text(page.read_text().replace("</body>", _MEASURE + "</body>"))
    done = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--window-size={WIDTH},{HEIGHT}", "--virtual-time-budget=10000", f"--user-data-dir={tmp / 'profile'}", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120)
    found = re.search(r'id="measured" data-json="([^"]*)"', done.stdout)
    assert found, f"the page was not measured: {done.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def assert_first_screen_answers(seen: dict, result: dict) -> None:
    assert seen["innerWidth"] == WIDTH
    assert seen["scrollWidth"] <= WIDTH  # nothing widens the page: wide tables scroll inside their own box
    assert seen["images"] and all(w > 0 for w in seen["images"])
    assert seen["firstTable"][0] <= seen["firstTable"][1]  # the compact decision table is not cut off
    sentences = {t.split(":", 1)[0]: t for t in seen["firstScreen"] if t.startswith("At ")}
    primary = [d for d in result["decisions"] if d["family"] == "primary"]
    assert primary
    for d in primary:  # every primary verdict is read in the window, in its scale's sentence
        assert f"{d['variant']} {d['verdict']}" in sentences[f"At {d['scale']}"]


@pytest.mark.integration
def test_the_demo_report_answers_in_the_first_screen_of_a_1280_pixel_window(chromium, tmp_path):
    uri = new_store(tmp_path / "mlflow.db")
    # shaped like `study demo`: its experiment file's decision rule, variants, one scale, 3 seeds, 3 tasks
    synthetic_store(uri, "demo", ["conventional", "hourglass", "tapered"], {"tiny": 2_000_000}, seeds=3, steps=40,
                    effects={"conventional": 0.0, "hourglass": -0.08, "tapered": 0.001})
    result = build_report("demo", tracking_uri=uri, out_dir=tmp_path / "reports", n_resamples=199,
                          log_to_mlflow=False)
    assert_first_screen_answers(measure(chromium, tmp_path / "reports" / "demo" / "report.html", tmp_path), result)


@pytest.mark.integration
def test_a_four_scale_report_fits_the_window_and_every_figure_loads(chromium, tmp_path):
    uri = new_store(tmp_path / "mlflow.db")
    synthetic_store(uri, "ffn_shape", ["conventional", "hourglass_attn", "hourglass_fixed", "tapered"],
                    ["113M", "256M", "440M", "906M"], seeds=4, steps=40, items_per_task=30,
                    effects={"conventional": 0.0, "hourglass_attn": -0.03, "hourglass_fixed": -0.004,
                             "tapered": 0.0})
    result = build_report("ffn_shape", tracking_uri=uri, out_dir=tmp_path / "reports", n_resamples=199,
                          log_to_mlflow=False)
    out = tmp_path / "reports" / "ffn_shape"
    seen = measure(chromium, out / "report.html", tmp_path)
    assert_first_screen_answers(seen, result)
    assert len(seen["images"]) == len(list(out.glob("*.png")))
