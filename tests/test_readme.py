"""The documentation's commands and links: every train.py command in a ```bash block of README.md
and docs/*.md (and lab/) composes, every script those blocks name exists, every relative link resolves.

lab/results.md is left out of the command check: its commands are hour-long CPU sweeps
(tests/test_multirun.py checks the experiment settings it quotes). Its links are checked.

A command is checked with `--cfg job` added: Hydra composes the config (presets, keys, types)
and prints it, and nothing trains. A sweep (-m) is checked as its first job.
"""
from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO
from tests.prestarted import run_python

README = REPO / "README.md"
README_MAX_CHARS = 12_000  # a first-hour page; the reference material lives in docs/
DOCS_MAX_CHARS = 130_000  # README.md and docs/*.md together
# The lab notebook's pages (lab/) are checked too, but for lab/BENCHMARKS.md, a log of dated
# measurements.
PAGES = [README, *sorted((REPO / "docs").glob("*.md")),
         *sorted(p for p in (REPO / "lab").glob("*.md") if p.name != "BENCHMARKS.md")]
COMMAND_PAGES = [p for p in PAGES if p != REPO / "lab" / "results.md"]

PYTHON = re.compile(r"^(\S*/)?python(3(\.\d+)*)?$")
# Hydra's own flags that do not run the app: such a command is run as written.
HYDRA_INFO_FLAGS = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc"}
SHELL_OPERATORS = {"&&", "||", ";", "|", "&"}
# Shell placeholders in the docs (<run_dir>, $HOST, ${RUN}) stand for a user's value; Hydra's
# ${now:...} and ${oc.env:...} interpolations have a colon and are not matched.
PLACEHOLDER = re.compile(r"<[A-Za-z][^<>]*>|\$\{\w+\}|\$\w+")
SUBSTITUTION = re.compile(r"\$\(([^()]*)\)")
NAMES_TRAIN = re.compile(r"(?<![\w-])train\.py\b|\bmake\s+run\b")  # not bench_train.py


class Unparsed(Exception):
    """A line that runs train.py in a form this test cannot read: the test fails naming it."""


def need(condition: object, message: str) -> None:
    if not condition:
        raise Unparsed(message)


@dataclass
class Command:
    where: str  # page:line, for the failure message
    text: str  # the command as the page writes it
    argv: list[str]  # train.py's arguments, as the test runs them


def bash_blocks(page: Path) -> list[tuple[int, str]]:
    """(line number, logical line) for every line of the page's ```bash blocks, with lines
    continued by a trailing backslash joined and indentation (blocks inside lists) removed."""
    lines, out = page.read_text().splitlines(), []
    in_bash, pending, start = False, "", 0
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if not in_bash:
            in_bash = stripped == "```bash"
            continue
        if stripped.startswith("```"):
            need(not pending, f"{page.name}:{start}: a ```bash block ends inside a continued line")
            in_bash = False
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        out.append((start, pending + stripped))
        pending = ""
    need(not in_bash, f"{page.name}: a ```bash block is never closed")
    return out


def first_of_sweeps(overrides: list[str], where: str) -> list[str]:
    """A sweep's overrides as one job of it: the first value of every swept key (--cfg cannot be
    combined with -m)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, out = OverridesParser.create(), []
    for text in overrides:
        if text.startswith("-"):  # a Hydra flag (--config-dir ...): kept as written
            out.append(text)
            continue
        try:
            override = parser.parse_override(text)
        except Exception as err:  # Hydra's parser names the problem; the test names the line
            raise Unparsed(f"{where}: cannot parse the override {text!r}: {err}") from err
        if override.is_sweep_override():
            first = next(iter(override.sweep_string_iterator()))
            text = f"{override.get_key_element()}={first}"
            need(not parser.parse_override(text).is_sweep_override(), f"{where}: cannot take one value of {text}")
        out.append(text)
    return out


def train_argv(tokens: list[str], where: str) -> list[str] | None:
    """train.py's arguments in one simple command; None when it does not run train.py."""
    if tokens[:2] == ["make", "run"]:
        need(all("=" in t for t in tokens[2:]), f"{where}: cannot parse `make run` arguments: {tokens[2:]}")
        args = [t.split("=", 1)[1] for t in tokens[2:] if t.startswith("ARGS=")]
        return shlex.split(args[-1]) if args else []
    if "train.py" not in tokens:
        need(not any(t.endswith("/train.py") for t in tokens), f"{where}: train.py by an unknown path: {tokens}")
        return None
    at = tokens.index("train.py")
    launcher, args = tokens[:at], tokens[at + 1:]
    while launcher and re.fullmatch(r"[A-Za-z_]\w*=.*", launcher[0]):  # OMP_NUM_THREADS=1 python ...
        launcher = launcher[1:]
    plain = len(launcher) == 1 and PYTHON.match(launcher[0])
    srun = len(launcher) == 2 and launcher[0] == "srun" and PYTHON.match(launcher[1])
    # torchrun's own options are all written --name=value in the docs, so none takes the next word.
    torchrun = launcher[:1] == ["torchrun"] and all(t.startswith("--") for t in launcher[1:])
    need(plain or srun or torchrun, f"{where}: train.py started by an unknown launcher: {launcher}")
    if "-m" in args or "--multirun" in args:
        return first_of_sweeps([a for a in args if a not in ("-m", "--multirun")], where)
    return args


def parse_line(line: str, where: str) -> list[list[str]]:
    """train.py's arguments for each command on one shell line."""
    found = []
    for inner in SUBSTITUTION.findall(line):  # eval "$(python train.py -sc install=bash)"
        found += parse_line(inner, where)
    line = PLACEHOLDER.sub("placeholder", SUBSTITUTION.sub("placeholder", line))
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError as err:
        raise Unparsed(f"{where}: cannot split {line!r}: {err}") from err
    command: list[str] = []
    for token in [*tokens, ";"]:
        if token not in SHELL_OPERATORS:
            need(not re.fullmatch(r"\d?>.*|<", token), f"{where}: cannot parse a redirection in {line!r}")
            command.append(token)
            continue
        if command:
            argv = train_argv(command, where)
            if argv is not None:
                found.append(argv)
        command = []
    return found


def doc_commands() -> tuple[list[Command], list[str]]:
    """Every train.py command of the docs' bash blocks, and the lines that name train.py (or
    `make run`) but could not be read as a command."""
    commands, unparsed = [], []
    for page in COMMAND_PAGES:
        try:
            lines = bash_blocks(page)
        except Unparsed as err:
            unparsed.append(str(err))
            continue
        for number, line in lines:
            where = f"{page.relative_to(REPO)}:{number}"
            try:
                argvs = parse_line(line, where)
            except Unparsed as err:
                unparsed.append(str(err))
                continue
            if not argvs and NAMES_TRAIN.search(line.split("#")[0]):
                unparsed.append(f"{where}: names train.py but no command was found in {line!r}")
            for argv in argvs:
                if not HYDRA_INFO_FLAGS.intersection(argv):
                    argv = [*argv, "--cfg", "job"]  # compose and print the config; nothing runs
                commands.append(Command(where, line, argv))
    return commands, unparsed


# Runs train.py as __main__ once per command in one process: importing torch once instead of
# once per command keeps the whole check to seconds on two cores.
DRIVER = r"""
import contextlib, io, json, os, runpy, sys
argvs, results, result_path = json.load(open(sys.argv[1])), [], sys.argv[2]
sys.path.insert(0, os.getcwd())  # as `python train.py` puts the script's dir first
for argv in argvs:
    sys.argv = ["train.py", *argv]
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path("train.py", run_name="__main__")
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except BaseException as exc:
            code, _ = 1, err.write(repr(exc))
    results.append({"code": code, "stderr": err.getvalue()[-2000:]})
json.dump(results, open(result_path, "w"))
"""


def test_every_train_command_in_the_docs_composes(tmp_path):
    commands, unparsed = doc_commands()
    assert not unparsed, "commands this test cannot read:\n" + "\n".join(unparsed)
    assert any(c.where.startswith("README.md") for c in commands), "no train.py command found in README.md"
    argv_file, result_file = tmp_path / "argv.json", tmp_path / "results.json"
    argv_file.write_text(json.dumps([c.argv for c in commands]))
    # A launcher's or scheduler's variables would make train.py ask for a shared run dir.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRAIN_RUN_ID")}
    proc = run_python(["-c", DRIVER, str(argv_file), str(result_file)], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(result_file.read_text())
    failed = [f"{c.where}: {c.text}\n  ran: train.py {shlex.join(c.argv)}\n  exit {r['code']}: {r['stderr'].strip()}"
              for c, r in zip(commands, results) if r["code"] != 0]
    assert not failed, "documented commands that do not compose:\n" + "\n".join(failed)


def test_scripts_named_in_the_docs_exist():
    missing = []
    for page in COMMAND_PAGES:
        for number, line in bash_blocks(page):
            for script in re.findall(r"(?<![\w/.-])(scripts/[\w./-]+\.py)\b", line):
                if not (REPO / script).is_file():
                    missing.append(f"{page.relative_to(REPO)}:{number}: {script}")
    assert not missing, "scripts named in the docs that do not exist:\n" + "\n".join(missing)


def markdown_links(page: Path) -> list[str]:
    """Link targets of the page's prose, inline and reference-style: code blocks and code spans
    hold no links."""
    text = re.sub(r"^\s*```.*?^\s*```", "", page.read_text(), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^()\s]+)\)", text) + re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", text, flags=re.M)


def test_relative_links_point_at_files():
    broken = []
    for page in PAGES:
        for target in markdown_links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, "relative links to missing files:\n" + "\n".join(broken)


def heading_anchors(page: Path) -> set[str]:
    """The #anchors a renderer gives the page's headings (GitHub's rule: lower case, spaces to
    '-', punctuation but '-' and '_' dropped); a second heading of one text gets '-1', '-2'..."""
    text = re.sub(r"^\s*```.*?^\s*```", "", page.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#+\s+(.*?)\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_relative_links_to_headings_name_one_that_is_there():
    """A heading renamed (a script moved into lab/tools/bench/, a section retitled) leaves links to
    its old anchor pointing at the top of the page."""
    broken = []
    for page in PAGES:
        for target in markdown_links(page):
            path, _, anchor = target.partition("#")
            if not anchor or re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue
            linked = (page.parent / path) if path else page
            if linked.suffix == ".md" and linked.exists() and anchor not in heading_anchors(linked):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, "links to headings that are not there:\n" + "\n".join(broken)
    assert "from-docsdatamd-the-tuning-split-measured" in heading_anchors(REPO / "lab" / "BENCHMARKS.md")


def test_the_readme_and_the_reference_pages_stay_within_their_size():
    """README.md and docs/*.md together, as `wc -c` counts: the study's dated findings belong in
    lab/, not in the reference."""
    size = sum(len(page.read_bytes()) for page in [README, *(REPO / "docs").glob("*.md")])
    assert size <= DOCS_MAX_CHARS, f"README.md and docs/*.md hold {size} bytes; move dated material to lab/"


def test_every_doc_page_links_back_to_the_readme():
    pages = [p for p in PAGES if p.parent == REPO / "docs"]
    assert pages, "no docs/*.md pages"
    lost = [p.name for p in pages if "../README.md" not in markdown_links(p)]
    assert not lost, f"docs pages without a link back to README.md: {lost}"


def test_readme_is_a_first_hour_page():
    size = len(README.read_bytes())  # as `wc -c` counts
    assert size <= README_MAX_CHARS, f"README.md has {size} bytes; move reference material to docs/"
