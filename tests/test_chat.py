"""`s2moe chat` on the embedded default model, driven through a pseudo-terminal (stdlib `pty`):
history across turns, /reset, Ctrl-C stopping a reply without leaving, /exit and Ctrl-C at the
prompt; piped stdin; the options it shares with `s2moe run`.

The default model has no chat template: the history is its messages joined by newlines (no jinja2).
"""

from __future__ import annotations

import fcntl
import inspect
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

STATS = re.compile(r"\[(?P<tokens>\d+) tok · (?P<rate>[\d.]+|-) tok/s · acceptance length (?P<length>[\d.]+|-)"
                   r"(?: \(accepted (?P<accepted>\d+)%\))? · (?P<mb>[\d.]+) MB fetched · prompt (?P<prompt>\d+) tok"
                   r"(?:, prefill [\d.]+ ms)? · stop: (?P<stop>\w+)\]\n")
PROMPT_LINE = re.compile(r"prompt: (?P<tokens>\d+) tokens, (?P<messages>\d+) messages: (?P<json>.*)\n")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]")
CLI = [sys.executable, "-m", "s2moe.runtime.cli", "chat"]
ENV = {**os.environ, "TERM": "dumb", "COLUMNS": "200", "S2MOE_DEBUG": "0"}


def _controlling_tty():
    """In the child: the pty becomes its controlling terminal (so \\x03 is a SIGINT) and Ctrl-C is
    not inherited as ignored."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Chat:
    """`s2moe chat ARGS` on a pseudo-terminal; ``expect`` reads until a pattern appears in the
    output (ANSI escapes and carriage returns removed) and returns the match and the text before it."""

    def __init__(self, *args: str):
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        self.proc = subprocess.Popen(CLI + list(args), stdin=slave, stdout=slave, stderr=slave, env=ENV,
                                     start_new_session=True, preexec_fn=_controlling_tty, close_fds=True)
        os.close(slave)
        self.fd, self.raw, self.at = master, b"", 0

    def text(self) -> str:
        return ANSI.sub("", self.raw.decode("utf-8", "replace")).replace("\r", "")

    def _read(self, timeout: float) -> bool | None:
        """Output within ``timeout``: True (read some), None (none yet), False (the terminal closed)."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return None
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        self.raw += data
        return bool(data)

    def expect(self, pattern, timeout: float = 30.0):
        pattern = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        alive = True
        while True:
            text = self.text()
            m = pattern.search(text, self.at)
            if m:
                before, self.at = text[self.at:m.start()], m.end()
                return m, before
            left = deadline - time.monotonic()
            if left <= 0 or not alive:
                self.close()
                pytest.fail(f"no {pattern.pattern!r} in the chat's output:\n{text[-3000:]}")
            alive = self._read(min(0.2, left)) is not False

    def send(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def ask(self, message: str) -> tuple[str, dict, dict]:
        """One turn with --verbose: (reply text, the prompt line's fields, the stats line's)."""
        self.expect(r"> ")
        self.send(message + "\r")
        prompt, _ = self.expect(PROMPT_LINE)
        stats, reply = self.expect(STATS)
        return reply, prompt.groupdict(), stats.groupdict()

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.1)
        while self._read(0.05):  # what is left in the terminal
            pass
        if self.proc.poll() is None:
            self.close()
            pytest.fail(f"s2moe chat did not exit:\n{self.text()[-3000:]}")
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:
            os.close(self.fd)
        except OSError:
            pass


def _check_stats(stats: dict, tokens: int | None = None, stop: str | None = None) -> None:
    assert stats["rate"] == "-" if int(stats["tokens"]) < 2 else float(stats["rate"]) > 0
    assert stats["length"] == "-" or float(stats["length"]) >= 1.0
    assert float(stats["mb"]) >= 0
    if tokens is not None:
        assert int(stats["tokens"]) == tokens
    if stop is not None:
        assert stats["stop"] == stop


def test_history_reset_and_ctrl_c_at_the_prompt():
    import json

    chat = Chat("--temperature", "0", "--max-tokens", "24", "--no-rg", "--verbose")
    try:
        first, p1, s1 = chat.ask("import os")
        _check_stats(s1, tokens=24, stop="max_tokens")
        assert json.loads(p1["json"]) == "import os\n" and p1["messages"] == "1"
        second, p2, s2 = chat.ask("class Stack:")
        _check_stats(s2, tokens=24, stop="max_tokens")
        # the second prompt is the first turn (message and reply, as streamed) and the new message
        assert p2["messages"] == "3"
        # (the printed reply ends with a newline: its own, or one printed before the stats line)
        assert json.loads(p2["json"]) in ("import os\n" + first + "\nclass Stack:\n",
                                          "import os\n" + first[:-1] + "\nclass Stack:\n")
        assert int(p2["tokens"]) > int(p1["tokens"]) + 10
        chat.expect(r"> ")
        chat.send("/reset\r")
        chat.expect(r"history cleared\n")
        again, p3, _ = chat.ask("import os")
        assert p3 == p1 and again == first  # greedy: a cleared history gives turn 1's reply
        chat.expect(r"> ")
        chat.send("/reset\r")
        chat.expect(r"history cleared\n")
        fresh, p4, _ = chat.ask("class Stack:")
        assert p4["messages"] == "1"
        assert fresh != second  # the history changed the reply to the same message
        chat.expect(r"> ")
        # Ctrl-C at the prompt leaves without a traceback. Not at once: readline prints the prompt
        # before it waits for input, and a SIGINT in between is seen only at the next key (CPython)
        time.sleep(0.5)
        chat.send("\x03")
        assert chat.wait() == 130
        assert "Traceback" not in chat.text() and "error:" not in chat.text()
    finally:
        chat.close()


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on():
    # --ignore-eos and 1500 tokens: still streaming when the Ctrl-C arrives
    chat = Chat("--temperature", "0", "--max-tokens", "1500", "--ignore-eos", "--no-rg", "--verbose")
    try:
        chat.expect(r"> ")
        chat.send("import os\r")
        chat.expect(PROMPT_LINE)
        chat.expect(r"\S")  # the first streamed text
        chat.send("\x03")
        stats, partial = chat.expect(STATS)
        s = stats.groupdict()
        _check_stats(s, stop="interrupted")
        assert 0 < int(s["tokens"]) < 1500
        # the next turn sees the partial reply in its history, and gets a whole reply
        chat.expect(r"> ")
        chat.send("def add(a, b):\r")
        prompt, _ = chat.expect(PROMPT_LINE)
        assert prompt["messages"] == "3"
        stats, _ = chat.expect(STATS)
        _check_stats(stats.groupdict(), tokens=1500, stop="max_tokens")
        chat.expect(r"> ")
        chat.send("/exit\r")
        assert chat.wait() == 0
        assert "Traceback" not in chat.text()
    finally:
        chat.close()


def test_piped_stdin_context_overflow_and_eof():
    long = " ".join(["word"] * 40)
    r = subprocess.run(CLI + ["-t", "0", "-n", "4", "--ctx-size", "16", "--method", "ar"],
                       input=f"{long}\n/nope\nimport os\n", capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 0, r.stderr  # EOF leaves
    lines = r.stderr.splitlines()
    overflow = [line for line in lines if "the context holds 16" in line]
    assert len(overflow) == 1 and "/reset" in overflow[0]
    assert any("unknown command /nope" in line for line in lines)
    stats = [STATS.search(line + "\n") for line in lines]
    stats = [m.groupdict() for m in stats if m]
    assert len(stats) == 1  # only the message that fits was answered
    assert stats[0]["tokens"] == "4" and stats[0]["length"] == "1.00" and stats[0]["prompt"] == "3"
    assert r.stdout.strip()
    assert "Traceback" not in r.stderr


def test_chat_takes_runs_options():
    from s2moe.runtime.cli import chat, run, serve

    run_opts = set(inspect.signature(run.run).parameters)
    chat_opts = set(inspect.signature(chat.chat).parameters)
    assert chat_opts == (run_opts - set(chat.OMITTED)) | {"chat_template", "system", "verbose"}
    assert run_opts - set(chat.OMITTED) <= chat.HANDLED  # every run flag kept is read by the session:
    read = set(re.findall(r"\bo\.(\w+)", inspect.getsource(chat.Session) + inspect.getsource(run.decoding_setup)))
    assert chat.HANDLED <= read  # by the session, or by the setup it shares with run
    # the definitions are run's (and serve's) own objects, --max-tokens a copy with its own default
    runs, chats = inspect.signature(run.run).parameters, inspect.signature(chat.chat).parameters
    assert chats["budget"].default is runs["budget"].default
    assert chats["chat_template"].default is inspect.signature(serve.serve).parameters["chat_template"].default
    assert chats["max_tokens"].default.default == chat.DEFAULT_MAX_TOKENS and runs["max_tokens"].default.default == 64


def test_help_lists_chat_and_its_flags():
    from typer.testing import CliRunner

    from s2moe.runtime.cli import app

    top = CliRunner().invoke(app, ["--help"])
    assert top.exit_code == 0 and re.search(r"^\s+chat\s", top.output, re.M)
    sub = CliRunner().invoke(app, ["chat", "--help"])
    assert sub.exit_code == 0
    for flag in ("--model", "--method", "--budget", "--temperature", "--profile", "--max-tokens", "--chat-template",
                 "--system"):
        assert flag in sub.output
    for flag in ("--prompt", "--json", "--trace", "--record-passes"):
        assert not re.search(rf"{flag}\b", sub.output)


def test_a_template_without_jinja2_names_the_fix(monkeypatch):
    from s2moe.runtime.errors import UsageError
    from s2moe.runtime.serve.chat import ChatTemplate

    monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)  # import fails as on a base install
    with pytest.raises(UsageError, match=r'pip install -e "\.\[serve\]"'):
        ChatTemplate("{{ messages[0].content }}", origin="tokenizer_config.json")
    assert ChatTemplate(None).render([{"role": "user", "content": "hi"}]) == "hi\n"  # no template: no jinja2
