#!/usr/bin/python3
"""The REPL on a real terminal (a pty): prompts, line editing input, Ctrl-C, history."""
import os
import pty
import select
import sys
import tempfile
import time

DLUA = os.path.abspath(sys.argv[1])
passed = failed = 0


def check(name, cond, detail=""):
    global passed, failed
    if cond:
        passed += 1
        print("ok   - " + name)
    else:
        failed += 1
        print("FAIL - " + name + ("\n       " + detail if detail else ""))


home = tempfile.mkdtemp()
env = dict(os.environ, HOME=home, TERM="dumb")
pid, fd = pty.fork()
if pid == 0:
    os.execve(DLUA, [DLUA], env)

buf = b""
pos = 0  # what earlier read_until calls consumed


def read_until(pattern, timeout=10.0):
    """Reads the terminal until `pattern` (bytes) appears after what earlier calls consumed."""
    global buf, pos
    end = time.time() + timeout
    while True:
        k = buf.find(pattern, pos)
        if k >= 0:
            pos = k + len(pattern)
            return True
        if time.time() >= end:
            return False
        r, _, _ = select.select([fd], [], [], 0.1)
        if r:
            try:
                data = os.read(fd, 4096)
            except OSError:
                return False
            if not data:
                return False
            buf += data


def send(s):
    os.write(fd, s.encode())


check("banner and prompt", read_until(b"> "), repr(buf[-200:]))
send("x = 40\r")
send("=x + 2\r")
check("expression prints", read_until(b"42"), repr(buf[-200:]))
send("for i = 1, 2 do\r")
check("incomplete chunk asks for more", read_until(b">> "), repr(buf[-200:]))
time.sleep(0.3)
os.write(fd, b"\x03")  # Ctrl-C at the prompt: drop the unfinished chunk
read_until(b"> ")
send("print('fresh' .. 'line')\r")
check("Ctrl-C at the prompt cancels the chunk", read_until(b"freshline"), repr(buf[-300:]))
send("while true do os.clock() end\r")
time.sleep(1.0)
os.write(fd, b"\x03")
check("Ctrl-C interrupts a running chunk", read_until(b"interrupted"), repr(buf[-300:]))
send("=x * 2\r")
check("the REPL survives the interrupt", read_until(b"80"), repr(buf[-300:]))
send("print(dlua.version())\r")
check("dlua is preloaded", read_until(b"0."), repr(buf[-300:]))
read_until(b"> ")  # Ctrl-D must reach the prompt: typed while a chunk runs, the tty may drop it
# Lines typed while a chunk ran (as above, under load) can leave libedit a line that is not
# empty, where Ctrl-D deletes a character instead of ending input: an empty line first.
send("\r")
read_until(b"> ")
time.sleep(0.2)
os.write(fd, b"\x04")  # Ctrl-D ends the REPL
status = None
end = time.time() + 10
resend = time.time() + 1
while time.time() < end:
    # libedit prints the prompt before it switches the terminal to raw mode; a Ctrl-D that
    # lands in between is an EOF of the cooked line discipline and is lost in the switch
    # (any readline program has this window). A user would press it again: so does the test.
    if time.time() > resend:
        os.write(fd, b"\x04")
        resend = time.time() + 1
    wpid, st = os.waitpid(pid, os.WNOHANG)
    if wpid:
        status = st
        break
    try:
        r, _, _ = select.select([fd], [], [], 0.1)
        if r:
            os.read(fd, 4096)
    except OSError:
        pass
if status is None:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
check("Ctrl-D exits with status 0", status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0,
      "status=%r" % (status,))
hist = os.path.join(home, ".dlua_history")
text = open(hist).read() if os.path.exists(hist) else ""
text = text.replace("\\040", " ")  # libedit's file format escapes spaces
check("history saved in ~/.dlua_history", "x = 40" in text and "=x + 2" in text, repr(text))

# A new session recalls the last line with the up arrow.
pid, fd = pty.fork()
if pid == 0:
    os.execve(DLUA, [DLUA], env)
buf, pos = b"", 0
read_until(b"> ")
send("\x1b[A\r")
check("history recalled in a new session", read_until(b"0.1"), repr(buf[-300:]))
read_until(b"> ")
os.write(fd, b"\x04")
end = time.time() + 10
reaped = False
while time.time() < end and not reaped:
    reaped = os.waitpid(pid, os.WNOHANG)[0] != 0
    try:
        if not reaped and select.select([fd], [], [], 0.1)[0]:
            os.read(fd, 4096)
    except OSError:
        pass
if not reaped:  # never leave a REPL behind
    os.kill(pid, 9)
    os.waitpid(pid, 0)

print("%d passed, %d failed" % (passed, failed))
sys.exit(0 if failed == 0 else 1)
