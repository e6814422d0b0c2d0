"""Docs that cannot rot: the commands and links in the Markdown files must work as written.

What is checked, in README.md, docs/**/*.md, launch/README.md and bench/README.md:

- every `python train.py …` (also under `accelerate launch`) loads its config with train.py's own
  `imba.training.config.load_config`, so an unknown key, a value of the wrong type or a missing `--config` file
  fails here exactly as it would stop the real run;
- every `python -m MODULE …` and `python bench/SCRIPT.py …` answers `--help` with exit status 0, and every
  `--flag` the docs pass it appears in that help (the sub-command's help for `data.prep.writers folder …` and the
  like);
- every relative link and image resolves to a file, and every `#anchor` to a heading of the target file.

Commands are read from shell code blocks (```bash, ```sh, plain ```) and from inline code spans; synopsis notation
(`[optional]`, `a|b` alternatives, placeholders such as `DIR`, `<run>`, `...`) is understood. Each test lists every
broken item, one `file:line: item: problem` line each. The negative tests at the end feed the same extractor and
checkers synthetic Markdown to show that each kind of breakage is caught.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

from imba.training.config import Config, ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), REPO / "launch" / "README.md",
        REPO / "bench" / "README.md"]

SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "zsh"}  # code blocks whose lines are commands
HELP_TIMEOUT_S = 600  # a guard against a hang, far above a --help on a loaded machine; never a verdict on the docs


# ---- reading Markdown -------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([^\s`]*)")
_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")


def markdown_lines(path: Path) -> list[tuple[int, str, str | None]]:
    """(line number, text, language) for each line of `path`: language is the info string of the fenced code block
    the line is in ("" for a plain ```), None for prose. The fence lines themselves are left out."""
    rows, fence, language = [], None, None
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = _FENCE.match(text)
        if fence is None and match:
            fence, language = match.group(1), match.group(2).lower()
        elif fence is not None and match and match.group(1).startswith(fence) and not match.group(2):
            fence = language = None
        else:
            rows.append((number, text, language))
    return rows


def prose_paragraphs(path: Path) -> list[tuple[int, list[str]]]:
    """The prose of `path` as (first line number, lines) paragraphs: runs of non-blank lines outside code blocks.
    Code spans and links never cross a paragraph, so they are searched paragraph by paragraph."""
    paragraphs: list[tuple[int, list[str]]] = []
    previous = None
    for number, text, language in markdown_lines(path):
        if language is not None or not text.strip():
            previous = None
            continue
        if previous is None or number != previous + 1:
            paragraphs.append((number, []))
        paragraphs[-1][1].append(text)
        previous = number
    return paragraphs


def code_spans(lines: list[str]) -> list[tuple[int, tuple[int, int], str]]:
    """(row in the paragraph, character span in its text, content) of each inline code span of a paragraph. In a
    table row `\\|` is how a `|` is written inside a span, so it is unescaped there."""
    text = "\n".join(lines)
    spans = []
    for match in _CODE_SPAN.finditer(text):
        row = text.count("\n", 0, match.start())
        content = match.group(2).replace("\n", " ")
        if lines[row].lstrip().startswith("|"):
            content = content.replace("\\|", "|")
        spans.append((row, match.span(), content))
    return spans


@dataclass(frozen=True)
class Snippet:
    """Text that may hold a command: one logical line of a shell code block, or an inline code span."""

    path: Path
    line: int
    text: str


def shell_snippets(path: Path) -> list[Snippet]:
    """The logical lines of the shell code blocks of `path`: comments dropped, `\\` continuations joined, a `$ `
    prompt removed."""
    snippets, pending = [], None
    for number, text, language in markdown_lines(path):
        if language not in SHELL_LANGUAGES:
            snippets, pending = snippets + ([pending] if pending else []), None
            continue
        text = strip_comment(text.strip())
        if pending is None:
            pending = Snippet(path, number, text[2:] if text.startswith("$ ") else text)
        else:
            pending = dataclasses.replace(pending, text=f"{pending.text} {text}")
        if pending.text.endswith("\\"):
            pending = dataclasses.replace(pending, text=pending.text[:-1].rstrip())
        else:
            snippets.append(pending)
            pending = None
    return snippets + ([pending] if pending else [])


def inline_snippets(path: Path) -> list[Snippet]:
    """The inline code spans of the prose of `path`."""
    return [Snippet(path, first + row, content)
            for first, lines in prose_paragraphs(path) for row, _, content in code_spans(lines)]


# ---- commands -----------------------------------------------------------------------------------------------------

_MAYBE_COMMAND = re.compile(r"(?:^|[\s/])(?:python[\d.]*|accelerate)\s")
_ENV_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")
_PYTHON = re.compile(r"(?:\S*/)?python(?:\d+(?:\.\d+)*)?")
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_SEPARATORS = {"&&", "||", ";", "|", "&"}
_PLACEHOLDER_KEYS = {"key", "section.key"}  # `python train.py [key=value ...]`: the synopsis, not a key


@dataclass(frozen=True)
class Command:
    """A documented command: `kind` is "train" (train.py), "module" (python -m) or "script" (bench/*.py), or
    "unreadable" when the text cannot be split into shell words (`problem` says why)."""

    path: Path
    line: int
    text: str
    kind: str
    target: str = ""
    args: tuple[str, ...] = ()
    problem: str = ""

    @property
    def where(self) -> str:
        return f"{shown(self.path)}:{self.line}"


def shown(path: Path) -> str:
    """`path` as a failure message names it: relative to the repository when inside it."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def strip_comment(text: str) -> str:
    """`text` without its trailing `# comment`: a `#` that starts a word outside quotes, as in the shell (shlex's
    own comment handling would also cut `README.md#anchor`)."""
    quote = None
    for i, char in enumerate(text):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip()
    return text


def drop_optional_brackets(words: list[str]) -> list[str]:
    """Synopsis `[--config FILE]`, `[DIR]` → its words; a bracket inside a word (`sample.prompts=[a, b]`) stays."""
    out, depth = [], 0
    for word in words:
        if word.startswith("[") and len(word) > 1:
            word, depth = word[1:], depth + 1
        if depth and word.endswith("]"):
            word, depth = word[:-1], depth - 1
        if word:
            out.append(word)
    return out


def _script_target(script: str, args: list[str]) -> tuple[str, str, list[str]] | None:
    """("train", "train.py", args) or ("script", "bench/x.py", args); None for scripts the docs test leaves alone."""
    script = script.removeprefix("./")
    if script == "train.py":
        return "train", script, args
    if script.startswith("bench/"):
        return "script", script, args
    return None


def _python_target(words: list[str]) -> tuple[str, str, list[str]] | None:
    """What `python WORDS` runs: ("module", name, args), ("train"/"script", path, args), or None (e.g. `-c`)."""
    if words[:1] == ["-m"] and len(words) > 1 and _MODULE_NAME.fullmatch(words[1]):
        return "module", words[1], words[2:]
    if words and words[0].endswith(".py"):
        return _script_target(words[0], words[1:])
    return None


def _launched_target(words: list[str]) -> tuple[str, str, list[str]] | None:
    """What `accelerate launch WORDS` runs: the first `-m MODULE` or `*.py` after the launcher's own options."""
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words) and _MODULE_NAME.fullmatch(words[i + 1]):
            return "module", words[i + 1], words[i + 2:]
        if word.endswith(".py"):
            return _script_target(word, words[i + 1:])
    return None


def parse_segment(words: list[str]) -> tuple[str, str, list[str]] | None:
    """(kind, target, args) of one simple command, past env-var assignments and `time`/`env` wrappers."""
    i = 0
    while i < len(words):
        if _ENV_ASSIGNMENT.match(words[i]) or words[i] == "env":
            i += 1
        elif words[i] in ("time", "/usr/bin/time"):
            i += 1
            while i < len(words) and words[i].startswith("-"):
                i += 1
        else:
            break
    words = words[i:]
    if words and _PYTHON.fullmatch(words[0]):
        return _python_target(words[1:])
    if words[:2] == ["accelerate", "launch"]:
        return _launched_target(words[2:])
    return None


def commands_in(snippet: Snippet) -> list[Command]:
    """The train.py, `python -m` and bench-script commands of a snippet (one per `&&`/`;`/`|` segment)."""
    text = " ".join(strip_comment(snippet.text).split())
    if not _MAYBE_COMMAND.search(text + " "):
        return []
    try:
        words = shlex.split(text)
    except ValueError as err:
        return [Command(snippet.path, snippet.line, text, "unreadable", problem=f"cannot split into words: {err}")]
    segments: list[list[str]] = [[]]
    for word in words:
        if word in _SEPARATORS:
            segments.append([])
        else:
            segments[-1].append(word)
    commands = []
    for segment in segments:
        parsed = parse_segment(segment)
        if parsed:
            kind, target, args = parsed
            commands.append(Command(snippet.path, snippet.line, text, kind, target,
                                    tuple(drop_optional_brackets(args))))
    return commands


def commands_in_file(path: Path) -> list[Command]:
    """Every command documented in `path`, code blocks first, then inline code spans."""
    return [command for snippet in shell_snippets(path) + inline_snippets(path) for command in commands_in(snippet)]


@functools.cache
def doc_commands() -> tuple[Command, ...]:
    return tuple(command for path in DOCS for command in commands_in_file(path))


def is_placeholder(value: str) -> bool:
    """A value the docs leave to the reader: `...`, `<run>`, `$VAR`, `a|b` alternatives, or an ALL-CAPS word as
    the value or as a path part (`DIR`, `CHECKPOINT`, `RUN/metrics.jsonl`)."""
    if any(mark in value for mark in ("...", "…", "$", "|")) or re.search(r"<[^<>]*>", value):
        return True
    return any(re.fullmatch(r"[A-Z][A-Z0-9_]*", part) for part in value.split("/"))


# ---- train.py commands --------------------------------------------------------------------------------------------

def _default_as_text(key: str) -> str | None:
    """The default of config key `key` written as an override value (JSON is YAML), or None when `key` is not a
    leaf key of `Config` (then load_config itself reports it)."""
    node = Config()
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or not hasattr(node, part):
            return None
        node = getattr(node, part)
    return None if dataclasses.is_dataclass(node) else json.dumps(node)


def train_problem(args: tuple[str, ...]) -> str | None:
    """Why `python train.py ARGS` would stop at start-up, or None. `--help`/`-h` prints the settings and exits;
    `--export` is train.py's own (its __main__ takes it first, with CHECKPOINT [EXPORT_DIR]; a bare
    `python train.py --export`, as in a table's command column, names the mode); everything else goes through
    `load_config`, as in train.py. A placeholder value is replaced by the key's default, so only the key is
    checked; a placeholder `--config FILE` is left out; a real one must exist."""
    if {"-h", "--help"} & set(args):
        return None  # train.py prints the settings and exits before reading anything else
    if args[:1] == ("--export",):
        return None if len(args) <= 3 else "usage: python train.py --export CHECKPOINT_FOLDER [EXPORT_DIR]"
    argv: list[str] = []
    words = iter(args)
    for word in words:
        if word == "--config" or word.startswith("--config="):
            config_file = word.partition("=")[2] if "=" in word else next(words, None)
            if config_file is None:
                argv.append(word)  # load_config reports the missing value
            elif not is_placeholder(config_file):
                if not (REPO / config_file).is_file():
                    return f"--config {config_file}: no such file"
                argv += ["--config", str(REPO / config_file)]
        elif word in ("...", "…") or word.partition("=")[0].lower() in _PLACEHOLDER_KEYS:
            continue
        elif "=" in word and not word.startswith("-"):
            key, _, value = word.partition("=")
            default = _default_as_text(key) if is_placeholder(value) else None
            argv.append(word if default is None else f"{key}={default}")
        else:
            argv.append(word)
    try:
        load_config(argv)
    except ConfigError as err:
        return str(err)
    return None


# ---- python -m MODULE / bench scripts -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Help:
    returncode: int | None  # None: timed out
    text: str  # stdout and stderr


@functools.cache
def run_help(target: tuple[str, ...]) -> Help:
    """`python TARGET --help` from the repository root, offline; cached per target (module or script, sub-command)."""
    try:
        done = subprocess.run([sys.executable, *target, "--help"], cwd=REPO, capture_output=True, text=True,
                              timeout=HELP_TIMEOUT_S, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    except subprocess.TimeoutExpired:
        return Help(None, f"timed out after {HELP_TIMEOUT_S} s")
    return Help(done.returncode, done.stdout + done.stderr)


def prefetch_help(targets) -> None:
    """Fill run_help's cache for `targets`, two subprocesses at a time."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(run_help, sorted(set(targets))))


def is_project_module(name: str) -> bool:
    """Whether `python -m name` runs code of this repository (data., imba., models., …), not an installed tool."""
    top = name.split(".")[0]
    return (REPO / top).is_dir() or (REPO / f"{top}.py").is_file()


def help_target(command: Command) -> tuple[str, ...]:
    """The interpreter arguments that run `command`'s module or script: ("-m", "data.prep.writers") or
    ("bench/x.py",)."""
    return ("-m", command.target) if command.kind == "module" else (command.target,)


def subcommands(help_text: str) -> tuple[list[str], str | None]:
    """The argparse sub-commands a help text lists (`usage: … {folder,table} ...`) and the one it marks
    "(default)", if any. A positional with choices (`{clip,vqa}`) or a repeated option (`[{a,b} ...]`) is not one."""
    match = re.search(r"(?<=\s)\{([\w,-]+)\} \.\.\.(?!\])", help_text)
    if not match:
        return [], None
    default = re.search(r"^\s+([\w-]+) \(default\)", help_text, re.MULTILINE)
    return match.group(1).split(","), default and default.group(1)


def help_targets_of(command: Command) -> list[tuple[str, ...]]:
    """The help texts the flags of `command` are checked against: its sub-command's (each alternative of `a|b`, or
    the default sub-command when none is given), else the module's own. Runs the module's --help (cached)."""
    main = help_target(command)
    choices, default = subcommands(run_help(main).text)
    if not choices:
        return [main]
    first = command.args[0] if command.args and not command.args[0].startswith("-") else None
    if first is None:
        return [main + (default,)] if default else [main]
    return [main + (sub,) for sub in first.split("|") if sub in choices] or [main]


def _help_failed(target: tuple[str, ...], help_: Help) -> str:
    """A one-line report of a --help that failed, with the last line it printed (usually the error)."""
    last = help_.text.strip().splitlines()[-1:] or [""]
    status = "timed out" if help_.returncode is None else f"exits {help_.returncode}"
    return f"`python {' '.join(target)} --help` {status}: {last[0][:160]}"


def module_problems(command: Command) -> list[str]:
    """Why a `python -m MODULE …` or `python bench/SCRIPT.py …` command is wrong: its --help fails, it names an
    unknown sub-command, or it passes a `--flag` its (sub-command's) help does not list. A module from outside the
    repository (pytest, venv) only has to be installed."""
    if command.kind == "module" and not is_project_module(command.target):
        top = command.target.split(".")[0]
        return [] if importlib.util.find_spec(top) else [f"no module named {top!r}"]
    main = help_target(command)
    main_help = run_help(main)
    if main_help.returncode != 0:
        return [_help_failed(main, main_help)]
    choices, _ = subcommands(main_help.text)
    problems = []
    if choices and command.args and not command.args[0].startswith("-"):
        unknown = [s for s in command.args[0].split("|") if not is_placeholder(s) and s not in choices]
        problems += [f"unknown sub-command {s!r} (choices: {', '.join(choices)})" for s in unknown]
    flags = [arg.partition("=")[0] for arg in command.args if arg.startswith("--") and len(arg) > 2]
    for target in help_targets_of(command):
        help_ = run_help(target)
        if help_.returncode != 0:
            problems.append(_help_failed(target, help_))
            continue
        problems += [f"{flag} is not in `python {' '.join(target)} --help`" for flag in flags
                     if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_.text)]
    return problems


# ---- links --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Link:
    path: Path
    line: int
    target: str

    @property
    def where(self) -> str:
        return f"{shown(self.path)}:{self.line}"


def links_in_file(path: Path) -> list[Link]:
    """Every `[text](target)` and `![alt](target)` in the prose of `path` (not inside code spans or blocks)."""
    links = []
    for first, lines in prose_paragraphs(path):
        text = "\n".join(lines)
        in_code = [span for _, span, _ in code_spans(lines)]
        for match in _LINK.finditer(text):
            if not any(start <= match.start() < end for start, end in in_code):
                links.append(Link(path, first + text.count("\n", 0, match.start()), match.group(1)))
    return links


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text (link and image syntax, HTML tags dropped) lower-cased, characters
    other than letters, digits, spaces, '-' and '_' removed (Unicode letters such as α or Σ stay), spaces → '-'.
    (`_emphasis_` keeps its underscores here, unlike on GitHub; no heading of these docs uses it.)"""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@functools.cache
def heading_anchors(path: Path) -> frozenset[str]:
    """The anchors of `path`: the slug of each ATX heading (the n-th repeat of a slug gets `-n`), plus explicit
    `<a id=…>`/`<a name=…>` anchors. Setext (underlined) headings are not read."""
    anchors, seen = set(), Counter()
    for _, text, language in markdown_lines(path):
        if language is not None:
            continue
        heading = re.match(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$", text)
        if heading:
            slug = github_slug(heading.group(1))
            anchors.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
            seen[slug] += 1
        anchors.update(re.findall(r"<a\s[^>]*(?:id|name)=[\"']([^\"']+)[\"']", text))
    return frozenset(anchors)


def link_problem(link: Link) -> str | None:
    """Why a relative link is broken (its file is missing, or its #anchor names no heading of a Markdown target),
    or None. URLs with a scheme (https:, mailto:) are not followed."""
    if re.match(r"[A-Za-z][\w+.-]*:", link.target):
        return None
    file_part, _, anchor = link.target.partition("#")
    file_part = unquote(file_part.partition("?")[0])
    if not file_part:
        destination = link.path
    elif file_part.startswith("/"):  # GitHub resolves these against the repository root
        destination = REPO / file_part.lstrip("/")
    else:
        destination = link.path.parent / file_part
    if not destination.exists():
        return f"{file_part}: no such file"
    if anchor and destination.suffix.lower() == ".md" and unquote(anchor) not in heading_anchors(destination):
        return f"no heading with anchor #{anchor} in {shown(Path(os.path.normpath(destination)))}"
    return None


# ---- failure lists (shared by the docs tests and the negative tests) ----------------------------------------------

def unreadable_failures(commands) -> list[str]:
    return [f"{c.where}: {c.text}: {c.problem}" for c in commands if c.kind == "unreadable"]


def train_failures(commands) -> list[str]:
    return [f"{c.where}: {c.text}: {problem}"
            for c in commands if c.kind == "train" and (problem := train_problem(c.args))]


def module_failures(commands) -> list[str]:
    commands = [c for c in commands if c.kind in ("module", "script")]
    project = [c for c in commands if c.kind == "script" or is_project_module(c.target)]
    prefetch_help(help_target(c) for c in project)
    prefetch_help(target for c in project for target in help_targets_of(c))
    hung = sorted({c.target for c in project if run_help(help_target(c)).returncode is None})
    if hung:  # a hang (or a machine far too busy) is not a mismatch between the docs and the command
        pytest.fail(f"--help timed out after {HELP_TIMEOUT_S} s: {', '.join(hung)}", pytrace=False)
    return [f"{c.where}: {c.text}: {problem}" for c in commands for problem in module_problems(c)]


def link_failures(links) -> list[str]:
    return [f"{link.where}: ({link.target}): {problem}" for link in links if (problem := link_problem(link))]


def report(failures: list[str], what: str) -> None:
    """Fail with every broken item listed, one per line."""
    if failures:
        pytest.fail(f"{len(failures)} {what}:\n" + "\n".join(failures), pytrace=False)


# ---- the docs -----------------------------------------------------------------------------------------------------

def test_documented_commands_split_into_shell_words():
    report(unreadable_failures(doc_commands()), "documented commands the shell cannot split")


def test_documented_train_commands_load_their_config():
    assert any(c.kind == "train" for c in doc_commands()), "no `python train.py` found: is the extractor broken?"
    report(train_failures(doc_commands()), "documented train.py commands would stop at start-up")


def test_documented_modules_and_scripts_take_their_flags():
    assert any(c.kind == "module" for c in doc_commands()), "no `python -m` found: is the extractor broken?"
    report(module_failures(doc_commands()), "documented module/script commands do not match their --help")


def test_relative_links_and_anchors_resolve():
    links = [link for path in DOCS for link in links_in_file(path)]
    assert links, "no links found: is the extractor broken?"
    report(link_failures(links), "broken links")


# ---- the checkers catch what they should (synthetic Markdown) ------------------------------------------------------

def _markdown(tmp_path: Path, text: str, name: str = "doc.md") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_extraction_reads_prompts_env_vars_continuations_comments_and_synopses(tmp_path):
    doc = _markdown(tmp_path, (
        "Run `python -m data.prep.writers folder\\|table SRC OUT` or, in a table:\n\n"
        "| `python train.py [--config FILE] [key=value ...] [--resume latest\\|none\\|DIR]` | train |\n\n"
        "```bash\n"
        "# a comment\n"
        "$ OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python3 train.py --config configs/tiny.yaml \\\n"
        "    loss.lam=0.5   # see README.md#loss\n"
        "accelerate launch --num_processes 2 -m data.prep.precompute in/ out/ --resolution 64 "
        "&& python bench/toy2d.py\n"
        "python -c 'print(1)'\n"
        "```\n"))
    got = [(c.line, c.kind, c.target, c.args) for c in commands_in_file(doc)]
    assert got == [
        (7, "train", "train.py", ("--config", "configs/tiny.yaml", "loss.lam=0.5")),
        (9, "module", "data.prep.precompute", ("in/", "out/", "--resolution", "64")),
        (9, "script", "bench/toy2d.py", ()),
        (1, "module", "data.prep.writers", ("folder|table", "SRC", "OUT")),
        (3, "train", "train.py", ("--config", "FILE", "key=value", "...", "--resume", "latest|none|DIR")),
    ]
    assert train_failures(commands_in_file(doc)) == []


@pytest.mark.parametrize("args, problem", [
    ("optim.lrr=1", "unknown config key 'optim.lrr' (did you mean optim.lr?)"),
    ("optim.lrr=DIR", "unknown config key 'optim.lrr' (did you mean optim.lr?)"),  # placeholder: key still checked
    ("train.max_steps=many", "config key 'train.max_steps' expects int, got 'many'"),
    ("--config configs/nope.yaml", "--config configs/nope.yaml: no such file"),
    ("--export ckpt out extra", "usage: python train.py --export CHECKPOINT_FOLDER [EXPORT_DIR]"),
    ("loss.gamma=0.5 --export ckpt", "cannot read argument '--export': overrides look like section.key=value "
                                     "(python train.py --help lists them)"),
    ("train.output_dir=DIR train.max_steps=<N> model.pretrained=... --config FILE --resume CHECKPOINT", None),
])
def test_train_checker_reports_what_train_py_would_reject(tmp_path, args, problem):
    doc = _markdown(tmp_path, f"Intro.\n\n```bash\npython train.py {args}\n```\n")
    expected = [f"{doc}:4: python train.py {args}: {problem}"] if problem else []
    assert train_failures(commands_in_file(doc)) == expected


def test_link_checker_reports_a_missing_file_and_a_missing_anchor(tmp_path):
    _markdown(tmp_path, "# Other\n\n## Fine-tuning PixArt-α and PixArt-Σ\n\n## Notes\n\n## Notes\n", "other.md")
    doc = _markdown(tmp_path, (
        "# Title\n\n"
        "See [ok](other.md#fine-tuning-pixart-α-and-pixart-σ), [dup](other.md#notes-1), [self](#title),\n"
        "![img](other.md), [web](https://example.com/x.md#nope), `[code](nowhere.md)`,\n"
        "[missing file](nowhere.md) and [missing anchor](other.md#notes-2).\n"
        "```\n[in a block](nowhere.md)\n```\n"))
    assert link_failures(links_in_file(doc)) == [
        f"{doc}:5: (nowhere.md): nowhere.md: no such file",
        f"{doc}:5: (other.md#notes-2): no heading with anchor #notes-2 in {tmp_path / 'other.md'}",
    ]


def test_module_checker_reports_flags_missing_from_the_help(tmp_path):
    doc = _markdown(tmp_path, (
        "```bash\n"
        "python -m data.prep.writers folder photos/ shards/ --samples-per-shard 10 --image-column image\n"
        "python bench/composition.py --quick --no-such-flag\n"
        "python -m data.prep.writers folders photos/ shards/\n"
        "python -m data.prep.concepts --shardz 'shards/{0..9}.tar' --out stats/\n"
        "```\n"))
    writers = "python -m data.prep.writers folder photos/ shards/ --samples-per-shard 10 --image-column image"
    assert module_failures(commands_in_file(doc)) == [
        f"{doc}:2: {writers}: --image-column is not in `python -m data.prep.writers folder --help`",  # table's flag
        f"{doc}:3: python bench/composition.py --quick --no-such-flag: "
        "--no-such-flag is not in `python bench/composition.py --help`",
        f"{doc}:4: python -m data.prep.writers folders photos/ shards/: "
        "unknown sub-command 'folders' (choices: folder, table)",
        f"{doc}:5: python -m data.prep.concepts --shardz 'shards/{{0..9}}.tar' --out stats/: "
        "--shardz is not in `python -m data.prep.concepts stats --help`",  # the sub-command its help marks (default)
    ]
