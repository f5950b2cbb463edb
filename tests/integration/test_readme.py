"""Every code block of README.md and of the site's pages (docs/, in mkdocs.yml's nav order),
executed as written, in that order, on a real store (issues 23 and 44).

The blocks build on each other (a run, then queries of its store; a page after the README and
the pages before it), so they run one after another in one shared folder: a copy of `configs/` beside links to the repository's `.venv`, Makefile,
pyproject.toml, requirements.lock and tests/, as a clone looks after `make install`.

- ```bash / ```sh: `bash` with `set -eo pipefail`, the venv's `bin/` first on PATH (the README's
  commands assume an activated venv), PREFECT_HOME in the folder, no PREFECT_API_URL;
- ```python: the venv's python reading the block on stdin (as pasted into a REPL in the folder);
- ```yaml: a whole config (it has `models`) is written into the folder's configs/ and checked by
  `pt2flow validate`; a fragment whose keys are a config's top-level keys, or a model's, is set
  into configs/demo.yaml's first model's config and checked with `pt2flow validate --no-import`;
  any other YAML is parsed; ```toml is parsed;
- an `s3://BUCKET` in a bash or python block is served by a moto S3 server on 127.0.0.1 (tests/s3.py),
  the bucket created empty, the block given its AWS_* variables;
- ```text / ```console / ```json show output or pictures and are never run; a fence naming no
  language, or another one, fails the test.

A block fails on a non-zero exit or a Python traceback anywhere in its output; the message names
the block's README line and shows its stderr. A comment on the line before a fence (blank lines
between are allowed) changes what is done with it:

    <!-- readme-test: skip: REASON -->          not run, counted; a marker without a reason fails;
                                                its `pt2flow` commands are checked as a synopsis's
    <!-- readme-test: env NAME=VALUE ... -->    run with these variables set (shlex-quoted values)
    <!-- readme-test: synopsis -->              a command reference: each `pt2flow` line's command,
                                                options and choices must exist in the CLI; not run
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

import pytest
import yaml

from tests.conftest import BIN, ROOT, stop_shared_server

pytestmark = pytest.mark.integration

README = ROOT / "README.md"
MKDOCS = ROOT / "mkdocs.yml"
SHELLS = {"bash", "sh", "shell"}
NOT_RUN = {"text", "console", "json"}  # output, pictures and documents: shown, never run
PARSED = {"yaml", "toml"}
BLOCK_TIMEOUT_S = 300
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[^`\s]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*readme-test:\s*(?P<body>.*?)\s*-->\s*$")
TRACEBACK = "Traceback (most recent call last)"
S3_BUCKET = re.compile(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?=[/\s\"')]|$)")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # a synopsis's metavar (`--stage S`), not a value
# what a README block may reach in the folder it runs in, besides configs/ (copied)
LINKED = ("Makefile", "pyproject.toml", "requirements.lock", "tests", "docs")


def documents() -> list[Path]:
    """README.md, then every page of the site in its nav's order (a generated page has no file)."""
    nav = yaml.safe_load(MKDOCS.read_text())["nav"]

    def pages(node: Any) -> Iterator[str]:
        if isinstance(node, str):
            yield node
        elif isinstance(node, dict):
            for value in node.values():
                yield from pages(value)
        elif isinstance(node, list):
            for value in node:
                yield from pages(value)

    docs = ROOT / yaml.safe_load(MKDOCS.read_text()).get("docs_dir", "docs")
    return [README, *(docs / page for page in pages(nav) if (docs / page).is_file())]


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_absolute() and path.is_relative_to(ROOT) else str(path)


@dataclass(frozen=True)
class Marker:
    line: int
    kind: str  # skip | env | synopsis
    reason: str = ""
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Block:
    line: int  # the document's line of the opening fence
    lang: str
    text: str
    marker: Marker | None
    source: str = "README.md"  # the document, relative to the repository

    @property
    def where(self) -> str:
        return f"{self.source} line {self.line} (```{self.lang})"

    @property
    def tag(self) -> str:
        """A file name for this block's output and configs: unique across documents."""
        stem = (
            "readme" if self.source == "README.md" else re.sub(r"[^A-Za-z0-9]+", "-", self.source.removesuffix(".md"))
        )
        return f"{stem}-line-{self.line}"


def parse_marker(body: str, line: int, source: str = "README.md") -> Marker:
    kind, _, rest = body.partition(" ")
    kind = kind.rstrip(":")
    rest = rest.strip()
    if kind == "skip":
        if not rest.strip(": "):
            raise AssertionError(
                f"{source} line {line}: `readme-test: skip` needs a reason (`<!-- readme-test: skip: why -->`)"
            )
        return Marker(line, "skip", reason=rest.lstrip(": ").strip())
    if kind == "env":
        pairs = shlex.split(rest)
        if not pairs or any("=" not in p or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", p) for p in pairs):
            raise AssertionError(f"{source} line {line}: `readme-test: env` takes NAME=VALUE pairs, not {rest!r}")
        return Marker(line, "env", env=dict(p.split("=", 1) for p in pairs))
    if kind == "synopsis" and not rest:
        return Marker(line, "synopsis")
    raise AssertionError(
        f"{source} line {line}: unknown marker `readme-test: {body}` (skip: REASON, env NAME=VALUE..., synopsis)"
    )


def parse_readme(text: str, source: str = "README.md") -> list[Block]:
    """The fenced code blocks of `text` with their markers; AssertionError for a marker that is
    malformed or stands before no fence, or a fence left open."""
    blocks: list[Block] = []
    lines = text.splitlines()
    pending: Marker | None = None
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        marker = MARKER.match(lines[i])
        if marker:
            if pending:
                raise AssertionError(
                    f"{source} line {pending.line}: a readme-test marker followed by another marker, not a code block"
                )
            pending = parse_marker(marker.group("body"), i + 1, source)
        elif fence:
            start, indent = i, len(fence.group("indent"))
            body: list[str] = []
            i += 1
            while i < len(lines) and not re.match(rf"^ {{0,{indent}}}```\s*$", lines[i]):
                body.append(lines[i][indent:] if lines[i].startswith(" " * indent) else lines[i].lstrip())
                i += 1
            if i == len(lines):
                raise AssertionError(f"{source} line {start + 1}: a code block is never closed")
            blocks.append(Block(start + 1, fence.group("lang"), "\n".join(body) + "\n", pending, source))
            pending = None
        elif lines[i].strip() and pending:
            raise AssertionError(
                f"{source} line {pending.line}: a readme-test marker must stand just before a code block"
            )
        i += 1
    if pending:
        raise AssertionError(f"{source} line {pending.line}: a readme-test marker after the last code block")
    return blocks


# --- the shared folder --------------------------------------------------------------------------


@dataclass
class Workspace:
    root: Path
    env: dict[str, str]
    tally: Counter[str] = field(default_factory=Counter)
    skipped: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    s3: Callable[[], Any] = lambda: None  # the session's moto S3 server (tests/s3.py), started on first use

    def run(
        self, block: Block, argv: list[str], *, stdin: str | None = None, extra_env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = {**self.env, **(extra_env or {})}
        try:
            proc = subprocess.run(
                argv, input=stdin, capture_output=True, text=True, cwd=self.root, env=env, timeout=BLOCK_TIMEOUT_S
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                f"{block.where} ran past {BLOCK_TIMEOUT_S} s:\n{block.text}\n--- stderr (tail) ---\n{_text(exc.stderr)[-6000:]}"
            ) from None
        log = self.root / "readme-output"  # each block's output, to read after a run (pytest --basetemp)
        log.mkdir(exist_ok=True)
        (log / f"{block.tag}.stdout").write_text(proc.stdout)
        (log / f"{block.tag}.stderr").write_text(proc.stderr)
        output = proc.stdout + proc.stderr
        if proc.returncode != 0 or TRACEBACK in output:
            why = f"exited {proc.returncode}" if proc.returncode else "printed a traceback"
            raise AssertionError(
                f"{block.where} {why}:\n{block.text}\n--- stderr (tail) ---\n{proc.stderr[-6000:]}\n--- stdout (tail) ---\n{proc.stdout[-2500:]}"
            )
        return proc


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Workspace]:
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "configs", root / "configs", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (root / ".venv").symlink_to(BIN.parent, target_is_directory=True)
    for name in LINKED:
        (root / name).symlink_to(ROOT / name)
    # a newcomer's shell: no Prefect, pt2flow, pytest or AWS settings of this session, and none of the
    # outer `make test`'s (its MAKEFLAGS would hand `make demo STORE=...` overrides down)
    inherited = ("PREFECT_", "PT2FLOW_", "PYTEST_", "AWS_", "MAKE", "MFLAGS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(inherited) and k != "PYTHONPATH"}
    env.update(
        PATH=os.pathsep.join([str(root / ".venv" / "bin"), env.get("PATH", "")]),
        PREFECT_HOME=str(root / ".prefect"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        VIRTUAL_ENV=str(root / ".venv"),
    )
    # `make` in the folder must not install anything: an out-of-date install would make it
    # pip-install the package from the temporary folder into the shared venv
    up_to_date = subprocess.run(["make", "-q", "install"], cwd=root, env=env, capture_output=True, text=True)
    if up_to_date.returncode != 0:
        pytest.fail(
            f"the install is out of date (`make -q install` exits {up_to_date.returncode}): run `make install` first"
        )
    yield Workspace(root, env, s3=lambda: request.getfixturevalue("moto_s3"))
    stop_shared_server(root / ".prefect")  # the walk's shared Prefect server (flows/engine/services/prefect_server.py)


# --- what each kind of block does -------------------------------------------------------------


def block_env(ws: Workspace, block: Block) -> dict[str, str]:
    """The marker's variables; and where the block names s3:// buckets, the moto server's AWS_*
    variables, with those buckets created (empty) first."""
    env = dict(block.marker.env) if block.marker else {}
    buckets = sorted(set(S3_BUCKET.findall(block.text)))
    if buckets:
        s3 = ws.s3()
        import boto3

        client = boto3.client("s3", endpoint_url=s3.url)
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        env.update(s3.env)
    return env


def run_shell(ws: Workspace, block: Block) -> None:
    script = "set -eo pipefail\n" + block.text
    ws.run(block, ["bash", "-c", script, f"{block.source}:{block.line}"], extra_env=block_env(ws, block))
    ws.tally["shell"] += 1


def run_python(ws: Workspace, block: Block) -> None:
    ws.run(block, [str(ws.root / ".venv" / "bin" / "python"), "-"], stdin=block.text, extra_env=block_env(ws, block))
    ws.tally["python"] += 1


def config_fields() -> tuple[set[str], set[str]]:
    from pt2flow.flows.config.models import ModelConfig, PipelineConfig

    return set(PipelineConfig.model_fields), set(ModelConfig.model_fields)


def check_yaml(ws: Workspace, block: Block) -> None:
    try:
        data = yaml.safe_load(block.text)
    except yaml.YAMLError as exc:
        raise AssertionError(f"{block.where} is not YAML: {exc}\n{block.text}") from None
    top_keys, model_keys = config_fields()
    path = ws.root / "configs" / f"{block.tag}.yaml"
    argv = [str(ws.root / ".venv" / "bin" / "pt2flow"), "validate", str(path.relative_to(ws.root))]
    if isinstance(data, dict) and "models" in data:
        path.write_text(block.text)
        ws.tally["yaml config validated"] += 1
    elif isinstance(data, dict) and data and (set(data) <= top_keys or set(data) <= model_keys):
        base = yaml.safe_load((ws.root / "configs" / "demo.yaml").read_text())
        base["models"] = base["models"][:1]
        if set(data) <= top_keys:
            base.update(data)
        else:
            base["models"][0].update(data)
        base.pop("store", None)
        path.write_text(yaml.safe_dump(base, sort_keys=False))
        argv.append("--no-import")
        ws.tally["yaml fragment validated"] += 1
    else:
        ws.tally["yaml parsed"] += 1
        return
    ws.run(block, argv)


def check_synopsis(ws: Workspace, block: Block) -> None:
    """Each line is `pt2flow COMMAND [ARGS]  # comment`, checked by command_problems."""
    lines = [
        (block.line + offset, line) for offset, line in enumerate(block.text.splitlines(), start=1) if line.strip()
    ]
    problems = command_problems(lines, block.source)
    assert not problems, f"{block.where}, a synopsis, names what the CLI does not have:\n" + "\n".join(problems)
    ws.tally["synopsis checked"] += 1


def command_problems(lines: list[tuple[int, str]], source: str = "README.md") -> list[str]:
    """For each (README line, `pt2flow COMMAND ...`): the command must exist, and so must every
    --option it names (with `[`, `]`, `=VALUE` stripped) and every value or `a|b` choice given to
    an option that takes choices (an upper-case word is a placeholder: `--stage S`, `COMMAND`)."""
    import click

    from pt2flow.flows.cli.main import cli

    problems = []
    for number, line in lines:
        where = f"{source} line {number}"
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = line.split()
        words = words[: next((i for i, w in enumerate(words) if w in {">", "|", "&&", ";"}), len(words))]
        if not words or words[0] != "pt2flow":
            problems.append(f"{where}: a synopsis line must start with `pt2flow`: {line.strip()}")
            continue
        command: click.Command | None = cli
        if len(words) > 1 and not words[1].startswith("-"):
            if PLACEHOLDER.match(words[1]):
                continue
            command = cli.get_command(None, words[1])  # type: ignore[attr-defined]
            if command is None:
                problems.append(f"{where}: no command `pt2flow {words[1]}`")
                continue
        options = {opt: param for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        options["--help"] = None  # type: ignore[assignment]
        for i, word in enumerate(words):
            name = word.strip("[]()").split("=", 1)[0]
            if not name.startswith("--"):
                continue
            if name not in options:
                problems.append(f"{where}: `pt2flow {command.name}` has no option {name}")
                continue
            param = options[name]
            value = words[i + 1].strip("[]()") if i + 1 < len(words) else ""
            if param is not None and isinstance(param.type, click.Choice) and value and not PLACEHOLDER.match(value):
                given = value.split("|")
                unknown = [g for g in given if g not in param.type.choices]
                if unknown:
                    problems.append(
                        f"{where}: {name} takes {'|'.join(map(str, param.type.choices))}, not {'|'.join(unknown)}"
                    )
    return problems


def inline_commands(text: str) -> list[tuple[int, str]]:
    """The README's inline code spans that are `pt2flow ...` commands, outside code blocks, with
    their line numbers (a span may wrap onto the next line)."""
    prose = []
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            prose.append("")
        else:
            prose.append("" if fenced else line)
    joined = "\n".join(prose)
    return [
        (joined.count("\n", 0, m.start()) + 1, m.group(1).replace("\n", " "))
        for m in re.finditer(r"(?<!`)`(pt2flow [^`]+)`(?!`)", joined)
    ]


# --- the tests ----------------------------------------------------------------------------------


def test_markers_are_well_formed() -> None:
    """The mechanism itself: a skip needs a reason, unknown markers and stray markers fail."""
    ok = parse_readme(
        "<!-- readme-test: skip: needs a GPU -->\n```bash\nnvidia-smi\n```\n<!-- readme-test: env A=1 B='x y' -->\n\n```sh\ntrue\n```\n"
    )
    assert [(b.marker.kind if b.marker else None) for b in ok] == ["skip", "env"]
    assert ok[0].marker and ok[0].marker.reason == "needs a GPU"
    assert ok[1].marker and ok[1].marker.env == {"A": "1", "B": "x y"}
    for bad, message in (
        ("<!-- readme-test: skip -->\n```bash\ntrue\n```\n", "needs a reason"),
        ("<!-- readme-test: skip:   -->\n```bash\ntrue\n```\n", "needs a reason"),
        ("<!-- readme-test: later -->\n```bash\ntrue\n```\n", "unknown marker"),
        ("<!-- readme-test: env A -->\n```bash\ntrue\n```\n", "NAME=VALUE"),
        ("<!-- readme-test: skip: why -->\nsome prose\n```bash\ntrue\n```\n", "just before a code block"),
        ("```bash\ntrue\n```\n<!-- readme-test: skip: why -->\n", "after the last code block"),
        ("```bash\ntrue\n", "never closed"),
    ):
        with pytest.raises(AssertionError, match=message):
            parse_readme(bad)


def test_the_commands_in_the_prose_exist() -> None:
    """`pt2flow ...` in the text (outside code blocks) of the README and of every page names real
    commands and options."""
    problems, count = [], 0
    for path in documents():
        spans = inline_commands(path.read_text())
        count += len(spans)
        problems += command_problems(spans, shown(path))
    assert count >= 40, count
    assert not problems, "the docs' text names what the CLI does not have:\n" + "\n".join(problems)


def test_a_skipped_blocks_commands_are_still_checked(tmp_path: Path) -> None:
    ws = Workspace(tmp_path, {})
    skip = Marker(3, "skip", reason="a server")
    ws_skip(
        ws,
        Block(
            4,
            "bash",
            "prefect server start\n.venv/bin/pt2flow serve c.yaml --cron '0 3 * * *' \\\n    --store ./s\n",
            skip,
        ),
    )
    assert ws.skipped == ["README.md line 4 (```bash): a server (1 pt2flow command(s) checked against the CLI)"]
    with pytest.raises(AssertionError, match=r"README.md line 7: `pt2flow serve` has no option --every"):
        ws_skip(ws, Block(4, "bash", "true\ntrue\n.venv/bin/pt2flow serve c.yaml --every 5\n", skip))


def test_a_failing_block_is_named_by_its_line_with_its_stderr(tmp_path: Path) -> None:
    ws = Workspace(tmp_path, {"PATH": os.environ["PATH"]})
    failing = Block(7, "bash", "echo made it\necho 'no such config' >&2\nfalse\necho never\n", None)
    with pytest.raises(AssertionError) as caught:
        run_shell(ws, failing)
    assert "README.md line 7 (```bash) exited 1" in str(caught.value) and "no such config" in str(caught.value)
    quiet_traceback = Block(9, "bash", "echo 'Traceback (most recent call last):' >&2\n", None)
    with pytest.raises(AssertionError, match=r"line 9 \(```bash\) printed a traceback"):
        run_shell(ws, quiet_traceback)


def test_every_readme_block_runs_as_written(workspace: Workspace, request: pytest.FixtureRequest) -> None:
    """README.md's blocks, then each page's in the site's nav order (docs/ pages that are not in
    the nav fail the strict site build: tests/test_docs.py)."""
    paths = documents()
    assert len(paths) >= 20 and paths[0] == README, paths
    blocks = [block for path in paths for block in parse_readme(path.read_text(), shown(path))]
    unlabelled = [f"{b.source} line {b.line}" for b in blocks if not b.lang]
    unknown = [
        f"{b.source} line {b.line} ({b.lang})"
        for b in blocks
        if b.lang and b.lang not in SHELLS | NOT_RUN | PARSED | {"python"}
    ]
    assert not unlabelled, f"code blocks without a language (```text for output and pictures): {', '.join(unlabelled)}"
    assert not unknown, f"code blocks in a language this test does not know: {', '.join(unknown)}"
    started = time.monotonic()
    for block in blocks:
        if block.marker and block.marker.kind == "skip":
            ws_skip(workspace, block)
            continue
        begun = time.monotonic()
        if block.marker and block.marker.kind == "synopsis":
            check_synopsis(workspace, block)
        elif block.lang in SHELLS:
            run_shell(workspace, block)
        elif block.lang == "python":
            run_python(workspace, block)
        elif block.lang == "yaml":
            check_yaml(workspace, block)
        elif block.lang == "toml":
            try:
                tomllib.loads(block.text)
            except tomllib.TOMLDecodeError as exc:
                raise AssertionError(f"{block.where} is not TOML: {exc}\n{block.text}") from None
            workspace.tally["toml parsed"] += 1
        else:
            workspace.tally["not run (output)"] += 1
        workspace.seconds[block.where] = time.monotonic() - begun
    total = time.monotonic() - started
    slowest = ", ".join(
        f"{where} {s:.0f} s" for where, s in sorted(workspace.seconds.items(), key=lambda kv: -kv[1])[:4]
    )
    summary = (
        f"README.md and {len(paths) - 1} pages: {len(blocks)} code blocks in {total:.0f} s: "
        + ", ".join(f"{n} {kind}" for kind, n in sorted(workspace.tally.items()))
        + (f", {len(workspace.skipped)} skipped" if workspace.skipped else "")
        + f" (slowest: {slowest})"
    )
    lines = [summary, *(f"  skipped {s}" for s in workspace.skipped)]
    request.config.pluginmanager.register(_Tally(lines), "readme-tally")
    print("\n" + "\n".join(lines))


def ws_skip(ws: Workspace, block: Block) -> None:
    """Not run; but a skipped shell block's `pt2flow` commands are still checked against the CLI."""
    assert block.marker
    commands = []
    if block.lang in SHELLS:
        lines: list[tuple[int, str]] = []  # (offset of its first line, the line with its continuations)
        for offset, line in enumerate(block.text.splitlines(), start=1):
            if lines and lines[-1][1].endswith("\\"):
                lines[-1] = (lines[-1][0], lines[-1][1][:-1] + " " + line)
            else:
                lines.append((offset, line))
        for offset, line in lines:
            words = line.split()
            if words and words[0].endswith("/pt2flow"):
                line = line.replace(words[0], "pt2flow", 1)
            if line.lstrip().startswith("pt2flow "):
                commands.append((block.line + offset, line.strip()))
    problems = command_problems(commands, block.source)
    assert not problems, f"{block.where}, skipped, names what the CLI does not have:\n" + "\n".join(problems)
    checked = f" ({len(commands)} pt2flow command(s) checked against the CLI)" if commands else ""
    ws.skipped.append(f"{block.where}: {block.marker.reason}{checked}")


class _Tally:
    """Prints the README tally at the end of the session (pytest captures the test's own output)."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        terminalreporter.write_sep("-", "code blocks of README.md and docs/")
        for line in self.lines:
            terminalreporter.write_line(line)
