"""`pglease completion bash|zsh`: the printed scripts work in a real shell."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pglease.cli import build_parser


def subcommands() -> list[str]:
    parser = build_parser()
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(action.choices)


def completion(shell: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    # No DSN anywhere and an empty embedded directory: printing a script must
    # neither connect nor start the embedded server.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PGLEASE_"))}
    env["PGLEASE_EMBEDDED_DIR"] = str(tmp_path / "embedded")
    return subprocess.run(
        [sys.executable, "-m", "pglease", "completion", shell],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


@pytest.fixture
def bash_script(tmp_path: Path) -> Path:
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    out = completion("bash", tmp_path)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "embedded").exists()  # nothing was started
    path = tmp_path / "pglease.bash"
    path.write_text(out.stdout)
    return path


def complete_in_bash(script: Path, line: str) -> list[str]:
    """What bash offers for `line` (the cursor at its end), through the script's
    registered completion function, as pressing Tab would call it."""
    probe = (
        f"source {script} || exit 9\n"
        "spec=$(complete -p pglease) || exit 8\n"
        'fn=$(sed -E "s/.* -F ([^ ]+) .*/\\1/" <<<"$spec")\n'
        'read -ra COMP_WORDS <<<"$LINE"\n'
        '[[ "$LINE" == *" " ]] && COMP_WORDS+=("")\n'
        "COMP_CWORD=$((${#COMP_WORDS[@]} - 1))\n"
        "COMP_LINE=$LINE; COMP_POINT=${#LINE}\n"
        '"$fn" pglease "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"\n'
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "LINE": line},
    )
    assert done.returncode == 0, done.stderr
    return sorted(w.strip() for w in done.stdout.splitlines() if w.strip())


def test_the_bash_script_registers_completion(bash_script: Path) -> None:
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", f"source {bash_script} && complete -p pglease"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("complete ") and " -F " in done.stdout
    assert done.stdout.split()[-1] == "pglease"
    # Without the script, bash knows no completion for pglease.
    bare = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", "complete -p pglease"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bare.returncode != 0


def test_the_bash_script_names_every_subcommand(bash_script: Path) -> None:
    text = bash_script.read_text()
    names = subcommands()
    assert {"claim", "ls", "top", "completion", "watch", "session"} <= set(names)
    for name in names:
        assert name in text, name
    assert complete_in_bash(bash_script, "pglease ") == names


def test_bash_completes_subcommands_options_and_choices(bash_script: Path) -> None:
    assert complete_in_bash(bash_script, "pglease cl") == ["claim"]
    assert complete_in_bash(bash_script, "pglease to") == ["top"]
    assert complete_in_bash(bash_script, "pglease completion ") == ["bash", "zsh"]
    assert complete_in_bash(bash_script, "pglease embedded ") == ["status", "stop"]
    assert complete_in_bash(bash_script, "pglease --sch") == ["--schema"]
    assert "--once" in complete_in_bash(bash_script, "pglease top --")
    assert complete_in_bash(bash_script, "pglease session ") == sorted(
        ["ls", "show", "fork", "export", "import"]
    )


def test_the_zsh_script(tmp_path: Path) -> None:
    out = completion("zsh", tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("#compdef pglease")
    for name in subcommands():
        assert name in out.stdout, name
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed: the script was checked as text only")
    fpath = tmp_path / "zfunc"
    fpath.mkdir()
    (fpath / "_pglease").write_text(out.stdout)
    done = subprocess.run(
        [
            "zsh", "-f", "-c",
            f"fpath=({fpath} $fpath); autoload -Uz compinit; compinit -u -d {tmp_path}/zcd;"
            " print -r -- ${_comps[pglease]}",
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "_pglease"


def test_an_unknown_shell_is_a_usage_error(tmp_path: Path) -> None:
    out = completion("fish", tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert "invalid choice: 'fish'" in out.stderr


# -- as a person types it: Tab in an interactive shell, in a real terminal (tmux) ------


def _typed(tmp_path: Path, shell: list[str], setup: str, typed: str, want: str) -> str:
    """Start `shell` in tmux, run `setup`, type `typed` and Tab; the pane once it shows `want`."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (.ci/run installs it on Debian)")
    socket = str(tmp_path / "s")

    def tmux(*args: str) -> str:
        return subprocess.run(
            ["tmux", "-S", socket, *args], capture_output=True, text=True, timeout=30, check=True
        ).stdout

    env = ["env", "-i", f"HOME={tmp_path}", "TERM=xterm", "PATH=/usr/bin:/bin"]
    tmux("new-session", "-d", "-s", "sh", "-x", "120", "-y", "20", shlex.join(env + shell))
    try:
        tmux("send-keys", "-t", "sh", setup + "; echo ready", "Enter")
        _wait(lambda: "\nready" in tmux("capture-pane", "-p", "-t", "sh"), "the setup")
        tmux("send-keys", "-t", "sh", typed, "Tab")
        pane = ""

        def shown() -> bool:
            nonlocal pane
            pane = tmux("capture-pane", "-p", "-t", "sh")
            return want in pane

        _wait(shown, f"{want!r} after typing {typed!r} and Tab", lambda: pane)
        return pane
    finally:
        subprocess.run(["tmux", "-S", socket, "kill-server"], capture_output=True, timeout=30)


def _wait(ok: Callable[[], bool], what: str, pane: Callable[[], str] = str) -> None:
    deadline = time.monotonic() + 60
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited 60 s for {what}; the pane shows:\n{pane()}")
        time.sleep(0.1)


def test_tab_completes_in_an_interactive_bash(bash_script: Path, tmp_path: Path) -> None:
    setup = f"PS1='$ '; source {bash_script}"
    shell = ["bash", "--norc", "--noprofile", "-i"]
    pane = _typed(tmp_path, shell, setup, "pglease to", "$ pglease top")
    assert "$ pglease top" in pane


def test_tab_completes_in_an_interactive_zsh(tmp_path: Path) -> None:
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed")
    out = completion("zsh", tmp_path)
    assert out.returncode == 0, out.stderr
    fpath = tmp_path / "zfunc"
    fpath.mkdir()
    (fpath / "_pglease").write_text(out.stdout)
    setup = (
        f"PROMPT='$ '; fpath=({fpath} $fpath); autoload -Uz compinit; compinit -u -d {tmp_path}/zcd"
    )
    pane = _typed(tmp_path, ["zsh", "-f", "-i"], setup, "pglease cl", "$ pglease claim")
    assert "$ pglease claim" in pane
