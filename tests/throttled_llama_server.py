#!/usr/bin/env python3
"""A real llama-server slowed down, standing in for a slower machine: the CPU child of a test
that needs a "GPU child" clearly faster than it, on a machine with no GPU and two cores (a
second thread for the "GPU child" is slower there, not faster, once anything else runs).

Named for what it is: a test double of the *hardware's speed*, not of llama-server. Spillway
starts it as a child's `llama_server`; it runs the real llama-server (REAL_LLAMA_SERVER) with
the same arguments and, once it is up, stops it (SIGSTOP) for THROTTLE_OFF_MS of every
THROTTLE_ON_MS + THROTTLE_OFF_MS (defaults 10 and 20: a third of its speed, in prefill and
generation alike; slices far shorter than any of Spillway's timeouts). Its output is the real
server's (inherited). SIGTERM and SIGINT go on to the server (continued first); the wrapper
ends as the server ends, with its status, or by the signal that ended it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def main() -> None:
    real = os.environ["REAL_LLAMA_SERVER"]
    on_s = float(os.environ.get("THROTTLE_ON_MS", "10")) / 1000
    off_s = float(os.environ.get("THROTTLE_OFF_MS", "20")) / 1000
    proc = subprocess.Popen([real, *sys.argv[1:]])

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while proc.poll() is None:
        time.sleep(on_s)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(off_s)
        proc.send_signal(signal.SIGCONT)
    code = proc.returncode
    if code < 0:  # ended by a signal: so is this process, as the server would have been
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
