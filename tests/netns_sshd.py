"""Runs a command in a private network namespace that has an OpenSSH server on 127.0.0.2 and 127.0.0.3.

  python tests/netns_sshd.py SSHD_CONFIG PORT -- COMMAND...

The namespace's only interface is its loopback, which carries all of
127.0.0.0/8, so the two addresses stand for two hosts of a job: tfdist-launch
(the COMMAND) reaches both over ssh, and TensorFlow's servers on either reach
each other. The server's log goes to sshd.log next to SSHD_CONFIG. SIGTERM and
SIGINT are passed on to the command; the exit status is the command's.
"""

import os
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfdist.launcher.launch import isolate_network  # noqa: E402

SSHD = "/usr/sbin/sshd"
ADDRESSES = ("127.0.0.2", "127.0.0.3")


def main() -> int:
    config, port = sys.argv[1], int(sys.argv[2])
    command = sys.argv[sys.argv.index("--") + 1:]
    isolate_network()
    with open(os.path.join(os.path.dirname(config), "sshd.log"), "ab") as log:
        sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", config], stdout=log, stderr=log)
    try:
        deadline = time.time() + 10
        for address in ADDRESSES:
            while True:
                try:
                    socket.create_connection((address, port), timeout=1).close()
                    break
                except OSError:
                    if time.time() > deadline or sshd.poll() is not None:
                        print(f"netns_sshd: sshd did not start listening on {address}:{port}", file=sys.stderr)
                        return 99
                    time.sleep(0.05)
        job = subprocess.Popen(command)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: job.send_signal(signum))
        return job.wait()
    finally:
        sshd.terminate()
        sshd.wait()


if __name__ == "__main__":
    sys.exit(main())
