"""Every `kvcalib COMMAND --flag` the README and docs/ show names an option that command has:
a renamed or removed flag fails here, not in a user's shell. Each command line is read from code
blocks (backslash continuations joined, `# comments` dropped) and from inline code spans; its
flags are looked up in that command's own `--help` (click's CliRunner, no model loaded)."""

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvcalib.cli import main

ROOT = Path(__file__).resolve().parents[2].parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# lm-eval's flags are lm-evaluation-harness's own (`kvcalib lm-eval` hands them over): its
# --help needs the ruler extra, and tests/toolkit/cli/test_lmeval.py runs that command line.
FOREIGN = {"lm-eval"}
COMMAND = re.compile(r"\bkvcalib ([a-z][a-z-]*)(?=\s|$)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def command_lines(text: str) -> list[str]:
    """The text after each `kvcalib ` in code: whole lines of fenced blocks, inline spans."""
    lines, fenced = [], False
    for block in re.split(r"^```.*$", text, flags=re.M):
        if fenced:
            joined = re.sub(r"\\\n\s*", " ", block)
            lines += [ln.split(" # ")[0] for ln in joined.splitlines()]
        else:
            lines += re.findall(r"`([^`\n]+)`", block)
        fenced = not fenced
    out = []
    for line in lines:
        starts = [m.start() for m in COMMAND.finditer(line)]  # one command up to the next
        ends = [*starts[1:], len(line)] if starts else []
        out += [line[a:b] for a, b in zip(starts, ends, strict=True)]
    return out


def uses() -> list[tuple[str, str, str]]:
    """(page, command, flag) for every flag on a kvcalib command line of every page."""
    found = []
    for page in PAGES:
        for line in command_lines(page.read_text()):
            command = COMMAND.match(line).group(1)
            for flag in FLAG.findall(line.split(" && ")[0].split(" | ")[0]):
                found.append((page.name, command, flag))
    return found


def _help(command: str) -> str:
    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0, (command, result.output)
    return result.output


def test_the_pages_name_flags_of_every_command():
    # The check must see the commands the README teaches, or it checks nothing.
    commands = {c for _, c, _ in uses()}
    assert {"calibrate", "convert", "eval", "generate", "lm-eval"} <= commands
    assert len(uses()) >= 30


def test_every_flag_on_a_documented_command_line_exists():
    helps, missing = {}, []
    for page, command, flag in uses():
        if command in FOREIGN or flag == "--help":
            continue
        if command not in main.commands:
            continue  # prose inside an error message ("kvcalib reads safetensors only")
        text = helps.setdefault(command, _help(command))
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
            missing.append(f"{page}: kvcalib {command} {flag}")
    assert missing == []


@pytest.mark.parametrize(
    "text, expected",
    [
        ("```bash\nkvcalib eval m \\\n    --residual 128   # not --this\n```", ["--residual"]),
        ("run `kvcalib convert --profile P` then", ["--profile"]),
        ("plain --prose-flag and `pip install --no-deps x`", []),
        (
            "`error: run kvcalib convert M --profile P, then kvcalib generate --chat`",
            ["--profile", "--chat"],
        ),
    ],
)
def test_command_lines_are_read_from_code(text, expected):
    flags = [f for ln in command_lines(text) for f in FLAG.findall(ln)]
    assert flags == expected


# Flags the pages name in a code span of their own that belong to another program.
OTHERS = {
    "--batch_size": "lm-eval's",
    "--device": "lm-eval's too, and kvcalib's",
    "--gpu-memory-utilization": "vLLM's server",
    "--enforce-eager": "vLLM's server",
    "--no-enable-prefix-caching": "vLLM's server",
    "--chat-template": "vLLM's server",
    "--version": "`vllm serve`'s",
}


def test_every_flag_named_alone_is_some_commands():
    # "`--sequential`", "`--residual N`": a flag named in prose, without its command, must still
    # be one of kvcalib's (or a program the table above names).
    helps = "".join(_help(c) for c in main.commands if c not in FOREIGN)
    missing = []
    for page in PAGES:
        for flag in re.findall(r"`(--[a-z][a-z0-9_-]*)[^`]*`", page.read_text()):
            known = re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helps)
            if not known and flag not in OTHERS:
                missing.append(f"{page.name}: {flag}")
    assert missing == []


def test_every_relative_link_resolves():
    # Pages moved into docs/ and notes into docs/notes/: a link written for the old place
    # points at nothing.
    pages = [*PAGES, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs" / "notes").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []
