"""The README and the docs as a new user meets them: every command in the
README runs as written from a fresh shell in the repository root, the docs'
links resolve in the built site, and every example of the migration page
runs.

The README's two set-up commands make a virtual environment and install
into it, which takes minutes: they are checked to be exactly the commands
the README promises (the test one is the line .ci/run runs), and the first
one is run on a copy of the checkout only when FASTSPAWN_TEST_SETUP_COMMANDS=1.
Every other command runs here, with ``.venv`` standing for the environment
that runs the tests.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

# Long, and the same on every CPython: CI runs them on one version (.ci/run).
pytestmark = pytest.mark.version_neutral

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CI_SCRIPT = ROOT / ".ci" / "run"

# The README's set-up commands for a fresh machine, each a block of its own.
SETUP_RUN = (
    "python3 -m venv .venv && .venv/bin/pip install -q . && .venv/bin/python examples/quickstart.py"
)
SETUP_TEST = "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/pytest -q"
SHELL_LANGUAGES = {"", "sh", "bash", "shell", "console"}
# What a launched program takes at most here; a hang fails the test, not CI.
TIMEOUT = 300

# A fenced block: its opening fence (maybe indented, in a list) and language,
# its body, and the closing fence at the same indent.
FENCE = re.compile(
    r"^(?P<indent> *)```(?P<language>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block in a Markdown text."""
    return [(m["language"], m["body"]) for m in FENCE.finditer(text)]


def block_commands(language: str, body: str) -> list[str]:
    """The command lines of a shell block: continuation lines joined, blank
    lines and comments left out; in a ``console`` block, the lines after a
    ``$`` prompt."""
    commands = []
    for line in body.replace("\\\n", " ").splitlines():
        if language == "console":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        if line.strip() and not line.lstrip().startswith("#"):
            commands.append(line.strip())
    return commands


def shell_blocks(path: Path) -> list[list[str]]:
    """The commands of each shell block of a Markdown file."""
    return [
        block_commands(language, body)
        for language, body in fenced_blocks(path.read_text())
        if language in SHELL_LANGUAGES
    ]


def python_blocks(path: Path) -> list[str]:
    return [body for language, body in fenced_blocks(path.read_text()) if language == "python"]


def ci_lines() -> list[str]:
    return CI_SCRIPT.read_text().splitlines()


def readme_commands() -> list[str]:
    """The README's commands other than the two set-up commands: each is run."""
    return [
        command
        for commands in shell_blocks(README)
        for command in commands
        if command not in (SETUP_RUN, SETUP_TEST)
    ]


def fresh_shell_env(tmp: Path) -> dict[str, str]:
    """The environment of a new shell of the user running the tests: no
    virtual environment activated (none of its variables, its bin out of
    PATH), temp files in ``tmp``."""
    venv_bins = {
        os.path.realpath(os.path.join(prefix, "bin"))
        for prefix in (sys.prefix, os.environ.get("VIRTUAL_ENV"))
        if prefix
    }
    path = [
        folder
        for folder in os.environ.get("PATH", os.defpath).split(os.pathsep)
        if folder and os.path.realpath(folder) not in venv_bins
    ]
    dropped = {"VIRTUAL_ENV", "VIRTUAL_ENV_PROMPT", "PYTHONHOME", "PYTHONPATH"}
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in dropped and not name.startswith("PYTEST_")
    }
    env.update(PATH=os.pathsep.join(path), TMPDIR=str(tmp))
    return env


def run_in_shell(command: str, cwd: Path, tmp: Path, timeout: float = TIMEOUT) -> str:
    """Run ``command`` as a new shell would (bash -c), and return its output;
    fail the test, with the output, unless it exits 0."""
    bash = shutil.which("bash")
    assert bash is not None, "bash is needed to run the README's commands"
    tmp.mkdir(exist_ok=True)
    done = subprocess.run(
        [bash, "-c", command],
        cwd=cwd,
        env=fresh_shell_env(tmp),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{output[-3000:]}"
    return output


def needs_torch(text: str) -> bool:
    """Whether a command or program needs torch: it imports torch, or runs
    an example that does."""
    if re.search(r"^\s*(import|from) torch\b|--preload torch|--standalone", text, re.MULTILINE):
        return True
    for example in re.findall(r"examples/[\w.-]+\.py", text):
        if needs_torch((ROOT / example).read_text()):
            return True
    return False


# -- the README's commands -----------------------------------------------------


def test_the_two_setup_commands():
    """Exactly two set-up commands, each alone in its block, in this order,
    and the test command is the one CI runs; no other command installs."""
    blocks = shell_blocks(README)
    setup = [commands for commands in blocks if SETUP_RUN in commands or SETUP_TEST in commands]
    assert setup == [[SETUP_RUN], [SETUP_TEST]]
    assert SETUP_TEST in ci_lines()
    for command in readme_commands():
        assert "pip install" not in command and "-m venv" not in command, command
    # The docs repeat them (the built site has no README): the same lines.
    for page in sorted(DOCS.glob("*.md")):
        for commands in shell_blocks(page):
            for command in commands:
                if "-m venv" in command:
                    assert command in (SETUP_RUN, SETUP_TEST), f"{page.name}: {command}"


def test_docs_build_command_is_cis():
    """The command that builds the docs, wherever the README or the docs
    give it, is the line CI runs, its programs in .venv/bin (not bare)."""
    commands = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for span in INLINE_CODE.findall(FENCE.sub("", page.read_text())):
            span = " ".join(span.split())
            if "mkdocs build" in span:
                assert ".venv/bin/mkdocs build" in span, f"{page.name}: {span}"
            if "'.[docs]'" in span:
                commands.append(span)
                assert span in ci_lines(), f"{page.name}: {span}"
    assert commands


def test_readme_links_resolve():
    """The README's links (read in the repository, where docs/ is beside
    it) name files that exist, and its anchors its own headings."""
    text = FENCE.sub("", README.read_text())
    headings = {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#+ (.*)$", text, re.MULTILINE)
    }
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        parts = urlsplit(link)
        if parts.scheme:
            continue
        if parts.path:
            assert (ROOT / parts.path).exists(), link
        else:
            assert parts.fragment in headings, link


def test_readme_commands_name_the_venvs_programs():
    """A program of the virtual environment (python, pip, fastspawn,
    pytest, ...) is named by its path: bare, it is whatever PATH finds in a
    fresh shell, or nothing.  And there are commands and code to run."""
    assert readme_commands() and python_blocks(README)
    for command in readme_commands():
        for piece in re.split(r"&&|\|\||[;|]", command):
            program = piece.split()[0]
            assert not (Path(sys.prefix, "bin", program).exists() and "/" not in program), command


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs(command, tmp_path):
    """Each command runs as written, from a fresh shell in the repository
    root, after the first set-up command: here a folder with the examples
    and a ``.venv`` that is the environment running the tests."""
    if needs_torch(command):
        pytest.importorskip("torch.distributed")
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "examples", root / "examples")
    (root / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    output = run_in_shell(command, cwd=root, tmp=tmp_path / "tmp")
    assert output.strip()


@pytest.mark.parametrize("index", range(len(python_blocks(README))))
def test_readme_python_runs(index, tmp_path):
    code = python_blocks(README)[index]
    if needs_torch(code):
        pytest.importorskip("torch.distributed")
    run_script(code, tmp_path)


@pytest.mark.timeout(1800)
def test_setup_command_on_a_fresh_copy(tmp_path):
    """The first set-up command, on a copy of the checkout as git would
    give it (what is committed and what is new, not what git ignores)."""
    if os.environ.get("FASTSPAWN_TEST_SETUP_COMMANDS") != "1":
        pytest.skip(
            "builds a virtual environment (minutes): FASTSPAWN_TEST_SETUP_COMMANDS=1 runs it"
        )
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to copy")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")  # fmt: skip
    copy = tmp_path / "checkout"
    for name in listed:
        source = ROOT / name
        if not name or name.startswith(".venv") or not source.is_file():
            continue  # a file deleted but not yet from the index
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, copy / name)
    output = run_in_shell(SETUP_RUN, cwd=copy, tmp=tmp_path / "tmp", timeout=1700)
    assert len(re.findall(r"^hello from rank \d ", output, re.MULTILINE)) == 8, output


def run_script(code: str, tmp_path: Path) -> None:
    """Run ``code`` as a script in a fresh interpreter; fail unless it exits 0."""
    script = tmp_path / "example.py"
    script.write_text(code)
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, f"exited {done.returncode}:\n{done.stdout}{done.stderr}"


# -- the pages whose examples run --------------------------------------------------

MIGRATING = DOCS / "migrating.md"
MULTIPROCESSING = DOCS / "multiprocessing.md"
EXAMPLE_PAGES = {page.name: page for page in (MIGRATING, MULTIPROCESSING)}


@pytest.mark.parametrize(
    "page, index",
    [(name, i) for name, page in EXAMPLE_PAGES.items() for i in range(len(python_blocks(page)))],
)
def test_page_example_runs(page, index, tmp_path):
    code = python_blocks(EXAMPLE_PAGES[page])[index]
    if needs_torch(code):
        pytest.importorskip("torch.distributed")
    run_script(code, tmp_path)


def test_migration_page_is_all_python():
    """Every code block of the page is one the test above runs."""
    blocks = fenced_blocks(MIGRATING.read_text())
    assert len(blocks) >= 3 and all(language == "python" for language, _ in blocks)


# -- the built site ------------------------------------------------------------


class _Page(HTMLParser):
    """The links (href, src) and the ids of an HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("href", "src"):
                self.links.append(value)
            elif name == "id" or (name == "name" and tag == "a"):
                self.ids.add(value)


def _target(site: Path, page: Path, path: str) -> Path:
    """The file a link's path names: from the site's root for an absolute
    path (404.html has those), else from the page's folder; a folder means
    its index.html."""
    base = site if path.startswith("/") else page.parent
    target = Path(os.path.normpath(base / unquote(path).lstrip("/")))
    return target / "index.html" if target.is_dir() else target


def test_docs_links_resolve(tmp_path):
    """Every relative link of every page of the built site names a file of
    the site, and its anchor (``#name``, on that page or this one) an id of
    that page."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("the docs toolchain (fastspawn[docs]) is absent")
    site = tmp_path / "site"
    (tmp_path / "tmp").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    pages = {}
    for path in site.rglob("*.html"):
        parsed = _Page()
        parsed.feed(path.read_text())
        pages[path] = parsed
    assert site / "migrating" / "index.html" in pages
    broken = []
    for page, parsed in sorted(pages.items()):
        for link in parsed.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc:
                continue  # another site, mailto:
            target = _target(site, page, parts.path) if parts.path else page
            where = f"{page.relative_to(site)}: {link}"
            if not target.is_file():
                broken.append(f"{where} (no {os.path.relpath(target, site)})")
            elif parts.fragment and target in pages and parts.fragment not in pages[target].ids:
                broken.append(f"{where} (no id {parts.fragment!r} there)")
    assert not broken, "\n".join(broken)
