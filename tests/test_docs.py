"""The documentation site (mkdocs.yml, docs/): its generated config reference names every field of
the config's JSON Schema, the site builds strict, and every page renders in headless Chromium with
no broken image, no empty section and no console error (issue 44).

The command blocks of docs/ run in tests/integration/test_readme.py, with the README's.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import re
import shutil
import subprocess
import threading
from pathlib import Path
from types import ModuleType
from collections.abc import Iterator

import pytest

from tests.conftest import BIN, ROOT

CHROMIUM = ("/usr/bin/chromium", "chromium", "chromium-browser")


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pt2flow_docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def listed_fields(page: str) -> dict[str, set[str]]:
    """Per `## section` of the config reference, the fields its table lists (first column)."""
    found: dict[str, set[str]] = {}
    section = None
    for line in page.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
            found[section] = set()
        elif section and (row := re.match(r"^\| `([^`]+)` \|", line)):
            found[section].add(row.group(1))
    return found


def test_the_config_reference_lists_every_field_of_the_schema() -> None:
    docs = hooks()
    schema = docs.schema()
    page = docs.config_reference(schema)
    expected = docs.fields(schema)
    assert listed_fields(page) == expected
    # what the comparison stands on: the schema's own nesting, not the generator's walk
    assert expected["config"] == set(schema["properties"]) and "models" in expected["config"]
    assert expected["model"] == set(schema["properties"]["models"]["items"]["properties"])
    assert {"factory", "dynamic_shapes", "require", "data"} <= expected["model"]
    assert expected["validate_options"] == set(schema["$defs"]["validate_options"]["properties"])
    assert expected["model.stages"] == set(
        schema["properties"]["models"]["items"]["properties"]["stages"]["properties"]
    )
    # every object of the schema, wherever it is written, is a section of the page
    assert len(expected) == sum(1 for node in objects_in(schema) if "properties" in node) + sum(
        1 for node in schema["$defs"].values() if "properties" not in node
    )
    # a field the schema gains must show up: the page is generated, so drop one and compare again
    schema["$defs"]["validate_options"]["properties"]["new_field"] = {"type": "integer", "default": 3}
    again = listed_fields(docs.config_reference(schema))
    assert "new_field" in again["validate_options"]
    assert "| `new_field` | integer | `3` |" in docs.config_reference(schema)


def objects_in(node: object) -> Iterator[dict]:
    """Every JSON object of the schema (a plain walk, not the generator's)."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from objects_in(value)
    elif isinstance(node, list):
        for value in node:
            yield from objects_in(value)


def test_the_cli_reference_has_every_command_s_own_help() -> None:
    from pt2flow.flows.cli.main import COMMANDS

    page = hooks().cli_reference()
    for name in COMMANDS:
        assert f"## pt2flow {name}\n\n```text\nUsage: pt2flow {name} " in page, name
    assert "--retry-failed" in page and "--keep-runs" in page  # options, as each command's --help has them


def chromium() -> str | None:
    return next((found for name in CHROMIUM if (found := shutil.which(name))), None)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`mkdocs build --strict` into a temporary folder: any warning (a broken link or anchor, a
    page missing from the nav, a docstring mkdocstrings cannot read) fails it."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


PAGE_CHECK = """() => {
  const article = document.querySelector('article');
  const broken = [...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src);
  const empty = [];
  const headings = [...article.querySelectorAll('h1, h2, h3, h4')];
  for (const h of headings) {
    const level = Number(h.tagName[1]);
    let next = h.nextElementSibling;
    while (next && next.classList.contains('headerlink')) next = next.nextElementSibling;
    const ends = !next || (/^H[1-4]$/.test(next.tagName) && Number(next.tagName[1]) <= level);
    if (ends) empty.push(h.textContent.replace('¶', '').trim());
  }
  return {title: document.title, text: article.innerText.length, broken, empty,
          svgs: document.querySelectorAll('article img[src$=".svg"]').length};
}"""


@pytest.mark.integration
def test_the_site_builds_strict_and_every_page_renders(site: Path, served: str, tmp_path: Path) -> None:
    browser = chromium()
    if browser is None:
        pytest.fail(
            "no chromium on PATH: `make test` installs Debian's chromium (make browser); see docs/contributing.md"
        )
    from playwright.sync_api import sync_playwright

    pages = sorted(str(p.relative_to(site)) for p in site.rglob("*.html") if p.name != "404.html")
    nav = (ROOT / "mkdocs.yml").read_text()
    listed = re.findall(r":\s*([\w/.-]+\.md)\s*$", nav, re.M)
    assert {page.removesuffix(".html") + ".md" for page in pages} == set(listed), "every page is in the nav"
    problems: list[str] = []
    seen: dict[str, dict] = {}
    with sync_playwright() as playwright:
        chrome = playwright.chromium.launch(
            executable_path=browser,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"],
        )
        view = chrome.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        view.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        view.on("pageerror", lambda e: errors.append(str(e)))
        # a request the next navigation cancelled (the favicon still in flight when the page went
        # network-idle, seen once in a loaded fresh clone) is not the page's fault; a resource
        # that is missing answers 404 (a console error), and a connection that fails is another failure
        view.on(
            "requestfailed",
            lambda r: (
                None if r.failure == "net::ERR_ABORTED" else errors.append(f"failed to load {r.url}: {r.failure}")
            ),
        )
        for page in pages:
            errors.clear()
            response = view.goto(f"{served}/{page}", wait_until="networkidle")
            assert response is not None and response.ok, page
            found = view.evaluate(PAGE_CHECK)
            seen[page] = found
            problems += [f"{page}: console: {e}" for e in errors]
            problems += [f"{page}: broken image {src}" for src in found["broken"]]
            problems += [f"{page}: empty section {title!r}" for title in found["empty"]]
            if found["text"] < 200:
                problems.append(f"{page}: almost no text ({found['text']} characters)")
            if page in ("index.html", "reference/config.html"):
                view.screenshot(path=str(tmp_path / page.replace("/", "-").replace(".html", ".png")), full_page=False)
        # the search box answers from the built index
        view.goto(f"{served}/index.html", wait_until="networkidle")
        view.locator("input.md-search__input").click()
        view.keyboard.type("retention")
        view.wait_for_selector(".md-search-result__item", timeout=10_000)
        hits = view.locator(".md-search-result__item").count()
        chrome.close()
    assert not problems, "\n".join(problems)
    assert hits > 0
    assert seen["benchmark-stage.html"]["svgs"] >= 1  # the plots are images the browser drew
    assert seen["reference/config.html"]["text"] > 10_000 and seen["reference/api.html"]["text"] > 2_000
