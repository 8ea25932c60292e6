"""tfdist.launcher.shaping / tfdist-launch --link_rate: a shaped loopback really slows the tasks' traffic.

Two tasks of a real launch exchange N bytes over their TF_CONFIG ports; under
--link_rate=R the transfer must take at least (N - burst) x 8 / R seconds,
less the token bucket's burst and one receive window, where unshaped loopback moves them in
milliseconds. The rates refused are checked through the command line.
"""

import re
import sys

import pytest

from tests.conftest import run_module
from tfdist.errors import UserError
from tfdist.launcher import shaping

pytestmark = pytest.mark.jobs

# worker:0 receives N bytes on its own port and prints how long they took; worker:1 sends them.
_TRANSFER = r"""
import json, os, socket, sys, time
config = json.loads(os.environ["TF_CONFIG"])
host, port = config["cluster"]["worker"][0].rsplit(":", 1)
size = int(sys.argv[1])
if config["task"]["index"] == 0:
    server = socket.create_server((host, int(port)))
    connection, _ = server.accept()
    got, start = 0, time.perf_counter()
    while got < size:
        got += len(connection.recv(1 << 20))
    print(f"received {got} bytes in {time.perf_counter() - start:.4f} s", flush=True)
    connection.sendall(b"k")
else:
    for _ in range(200):
        try:
            client = socket.create_connection((host, int(port)))
            break
        except OSError:
            time.sleep(0.05)
    client.sendall(b"x" * size)
    client.recv(1)
"""


def _transfer_seconds(*launch_args, size):
    result = run_module("tfdist.cli.launch", ["--num_workers=2", *launch_args, "--", sys.executable, "-c", _TRANSFER,
                                              str(size)], timeout=120)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return float(re.search(r"received \d+ bytes in ([\d.]+) s", result.stdout).group(1)), result.stdout


@pytest.mark.skipif(shaping.find_tc() is None,
                    reason="tc (Debian's iproute2) is not installed; the nox sessions install it as root")
def test_a_transfer_of_n_bytes_takes_at_least_n_over_the_rate():
    size, rate = 8_000_000, 100e6
    shaped, output = _transfer_seconds("--link_rate=100mbit", size=size)
    assert "tfdist-launch: the job's loopback is shaped to 100mbit (qdisc add dev lo root tbf rate 100000000bit" \
        in output, output
    # The bucket's burst may pass at once, and one window of bytes may arrive before accept() returns.
    floor = (size - shaping.burst_bytes(rate) - 65536) * 8 / rate
    unshaped, _ = _transfer_seconds(size=size)
    print(f"{size} bytes: {shaped:.3f} s at 100mbit (at least {floor:.3f} s), {unshaped:.4f} s unshaped")
    assert shaped >= floor and unshaped < floor / 4


def test_rates_are_parsed_as_tc_units():
    assert shaping.parse_rate("1gbit") == 1e9 and shaping.parse_rate("200mbit") == 200e6
    assert shaping.parse_rate("2.5Gbit") == 2.5e9 and shaping.parse_rate("1000kbit") == 1e6
    assert shaping.burst_bytes(1e9) == 1_250_000 and shaping.burst_bytes(10e6) == 131072
    for bad in ("fast", "1gb", "0mbit", "500kbit", "1000gbit", "-1gbit", ""):
        with pytest.raises(UserError, match=r"is not a link rate tfdist-launch can shape: give a number and kbit"):
            shaping.parse_rate(bad)


@pytest.mark.parametrize("args, expected", [
    (["--link_rate=1gb"], "--link_rate='1gb' is not a link rate tfdist-launch can shape: give a number and kbit, "
                          "mbit or gbit, from 1mbit to 100gbit (e.g. --link_rate=1gbit or --link_rate=200mbit)."),
    (["--link_rate=1gbit", "--network=host"], "--link_rate shapes the private loopback of a local launch; with "
                                              "--hosts or --network=host the tasks use real network links"),
    (["--link_rate=1gbit", "--hosts=a,b"], "--link_rate shapes the private loopback of a local launch"),
])
def test_bad_link_rates_are_refused_in_one_paragraph(args, expected):
    result = run_module("tfdist.cli.launch", [*args, "--", "true"], timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("tfdist-launch: error: ") and expected in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1
