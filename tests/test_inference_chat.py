"""marlhf chat driven through a pseudo-terminal: two turns with the first turn and its answer in the
second prompt, /reset forgets them, /quit and end of input (Ctrl-D) exit with status 0."""

import os
import re
import select
import subprocess
import time

import pytest
from conftest import REPO, cli_cmd

CHAT = "chat"


class Terminal:
    """The chat running on the slave side of a pty; the test types and reads on the master side."""

    def __init__(self, argv):
        self.master, slave = os.openpty()
        env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "dumb"}
        self.proc = subprocess.Popen([*cli_cmd(CHAT), *argv], stdin=slave, stdout=slave,
                                     stderr=subprocess.DEVNULL, env=env, close_fds=True)
        os.close(slave)
        self.seen = ""

    def read_until(self, marker: str, timeout: float = 120) -> str:
        """Output up to and including the next ``marker`` (the terminal turns \\n into \\r\\n)."""
        deadline = time.time() + timeout
        while marker not in self.seen:
            assert time.time() < deadline, f"no {marker!r} in {self.seen[-2000:]!r}"
            ready, _, _ = select.select([self.master], [], [], 0.5)
            if ready:
                try:
                    self.seen += os.read(self.master, 4096).decode("utf-8", "replace").replace("\r\n", "\n")
                except OSError:  # the child closed the terminal
                    assert marker in self.seen, f"exited before {marker!r}: {self.seen[-2000:]!r}"
        head, _, self.seen = self.seen.partition(marker)
        return head

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> int:
        try:
            code = self.proc.wait(timeout=60)
        finally:
            os.close(self.master)
        return code


@pytest.fixture(scope="module")
def nano():
    from marlhf import embedded

    return str(embedded.prepare(size="nano").model_dir)


def prompt_block(output: str) -> str:
    match = re.search(r"\[prompt\]\n(.*)\n\[/prompt\]", output, re.S)
    assert match, output
    return match.group(1)


def test_two_turns_keep_history_reset_and_quit(nano):
    term = Terminal(["--model", nano, "--show_prompt", "--max_new_tokens", "6", "--seed", "3"])
    term.read_until("You> ")
    term.type("where is my cat\n")
    first = term.read_until("You> ")
    assert prompt_block(first) == "\n\nHuman: where is my cat\n\nAssistant:"
    answer = re.search(r"Assistant> (.*)\n", first).group(1)
    term.type("and the dog\n")
    second = prompt_block(term.read_until("You> "))
    assert second == f"\n\nHuman: where is my cat\n\nAssistant: {answer}\n\nHuman: and the dog\n\nAssistant:"
    term.type("/reset\n")
    assert "(history cleared)" in term.read_until("You> ")
    term.type("hello\n")
    assert prompt_block(term.read_until("You> ")) == "\n\nHuman: hello\n\nAssistant:"
    term.type("/quit\n")
    assert term.close() == 0


def test_end_of_input_exits_cleanly(nano):
    term = Terminal(["--model", nano, "--max_new_tokens", "4"])
    term.read_until("You> ")
    term.type("hi\n")
    assert "Assistant> " in term.read_until("You> ")
    term.type("\x04")  # Ctrl-D at the start of a line: end of input
    assert term.close() == 0
