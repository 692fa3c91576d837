"""The HTML report of ``recompile inspect`` in a real browser: headless chromium renders it, the DOM has the
regions and stages, every in-page link resolves, and a screenshot is taken."""
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser

import pytest

from recompile import cli
from recompile.pipeline import PASS_ORDER
from test_inspect import HERE

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
WINDOW = (1400, 1000)


class Elements(HTMLParser):
    """Every element of a document as (tag, attributes)."""

    def __init__(self, text: str):
        super().__init__()
        self.elements: list[tuple[str, dict]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    def find(self, tag: str, cls: str | None = None) -> list[dict]:
        return [a for t, a in self.elements if t == tag and (cls is None or cls in (a.get("class") or "").split())]


def chromium(tmp_path, *args) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("chromium is not installed; `make browser` installs it (Debian package chromium)")
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    return subprocess.run(
        [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=120
    )


def png_size_and_colors(path) -> tuple[tuple[int, int], int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    pos, idat = 8, b""
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        if kind == b"IDAT":
            idat += data[pos + 8 : pos + 8 + length]
        pos += 12 + length
    return (width, height), len(set(zlib.decompress(idat)))


def render(tmp_path, *extra) -> tuple[str, Elements]:
    html = tmp_path / "report.html"
    assert cli.main(["inspect", f"{HERE}:hstu_model", "--html", str(html), *extra]) == 0
    dom = chromium(tmp_path, "--dump-dom", html.as_uri())
    assert dom.returncode == 0, dom.stderr
    return html.read_text(), Elements(dom.stdout)


def test_report_renders_regions_stages_and_profile(tmp_path):
    text, dom = render(tmp_path, "--target", "cpu", "--profile")
    for forbidden in ("<script", "<link", " src=", "url("):  # self-contained: nothing fetched at view time
        assert forbidden not in text
    [region] = dom.find("tr", "region")
    assert region["id"] == "region-0" and region["data-kind"] == "jagged"
    assert [s["data-stage"] for s in dom.find("div", "stage")] == ["captured", *PASS_ORDER]
    marked = {(n["id"].split("-node-")[0], n["data-node"]) for n in dom.find("g", "region-node")}
    # the replaced code in the stage the jagged pass started from, the op it became in the stage after
    jagged = 1 + PASS_ORDER.index("jagged")
    assert {(f"g0-s{jagged - 1}", "cumsum"), (f"g0-s{jagged - 1}", "offsets")} <= marked
    assert any(prefix == f"g0-s{jagged}" and name.startswith("complete_cumsum") for prefix, name in marked)
    assert {a["data-region"] for a in dom.find("span", "region-line")} == {"0"}
    ids = {a["id"] for _, a in dom.elements if "id" in a}
    links = [a["href"][1:] for a in dom.find("a") if a.get("href", "").startswith("#")]
    assert "region-0" in links and set(links) <= ids
    assert len(dom.find("td", "num")) == 3  # eager ms, fused ms, speedup

    shot = tmp_path / "report.png"
    result = chromium(tmp_path, f"--screenshot={shot}", f"--window-size={WINDOW[0]},{WINDOW[1]}", (tmp_path / "report.html").as_uri())
    assert result.returncode == 0, result.stderr
    size, colors = png_size_and_colors(shot)
    assert size == WINDOW and colors > 50  # drawn, not blank


def test_npu_report_says_plan_only(tmp_path):
    _, dom = render(tmp_path, "--target", "npu")
    assert dom.find("p", "plan-only")
    assert dom.find("section") and [s["id"] for s in dom.find("section")][:3] == ["regions", "plan", "summary"]
