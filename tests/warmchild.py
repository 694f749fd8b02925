"""`python -m warmchild GO [EXIT|raise]` for test_warm: what a rank sees of its start (the
secret's hash, environment, folder, session, argv, whether torch was imported before its first
line ran, its pid, parent and umask, its whole environment's hash), then it imports torch (a
no-op when warm), waits for the file GO, exits with status EXIT or raises."""

import hashlib
import json
import os
import sys
import time

warm = "torch" in sys.modules  # a fresh `python -m warmchild` has not imported it yet
secret = sys.stdin.readline().strip().encode()
print("got", hashlib.sha256(secret).hexdigest(), flush=True)
print("env", os.environ.get("SMOL_WARM_TEST"), "cwd", os.getcwd(), flush=True)
print("own session", os.getsid(0) == os.getpid(), "argv", sys.argv[1:], flush=True)
mask = os.umask(0)
print("warm", warm, "pid", os.getpid(), "ppid", os.getppid(), "umask", oct(mask), flush=True)
print("environ", hashlib.sha256(json.dumps(sorted(os.environ.items())).encode()).hexdigest(), flush=True)
import torch  # noqa: E402,F401 (what a rank imports: free when the server did)

if sys.argv[2:] == ["raise"]:
    raise RuntimeError("boom: no such model")
if sys.argv[2:]:
    print("exiting", sys.argv[2])  # no flush: the exit flushes it, as a fresh interpreter's would
    sys.exit(int(sys.argv[2]))
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
print("last line", flush=True)
