"""`python -m forkchild GO [EXIT|raise]` for test_launcher: what a rank sees of its start (the
secret's hash, environment, working folder, session, argv, what the server imported), then it
waits for the file GO, exits with status EXIT or raises."""

import hashlib
import os
import sys
import time

secret = sys.stdin.readline().strip().encode()
print("got", hashlib.sha256(secret).hexdigest(), flush=True)
print("env", os.environ.get("SMOL_FORK_TEST"), "cwd", os.getcwd(), flush=True)
print("own session", os.getsid(0) == os.getpid(), "argv", sys.argv[1:], flush=True)
print("colorsys already imported", "colorsys" in sys.modules, flush=True)
if sys.argv[2:] == ["raise"]:
    raise RuntimeError("boom: no such model")
if sys.argv[2:]:
    print("exiting", sys.argv[2])  # no flush: the exit flushes it, as a fresh interpreter's would
    sys.exit(int(sys.argv[2]))
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
print("last line", flush=True)
