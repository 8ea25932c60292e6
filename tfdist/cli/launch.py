"""tfdist-launch: start a multi-process job on this machine, or print its TF_CONFIGs.

  tfdist-launch --num_workers=2 -- tfdist-train --strategy=multi_worker_mirrored --workdir=W
  tfdist-launch --print_tf_config --num_workers=2 --hosts=node1:2222,node2:2222

Every task gets a free port on the loopback interface and its own TF_CONFIG;
output lines are prefixed with the task's role and index; SIGINT/SIGTERM are
forwarded; when one task fails the others are stopped and the launcher exits
with the failing task's status and shows its last lines.
"""

from __future__ import annotations

import argparse
import sys

from tfdist.cli import common
from tfdist.errors import UserError
from tfdist.launch import ClusterLayout, Launcher, cluster_spec, isolate_network, tf_config


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1:]
    else:
        own, command = argv, []
    parser = argparse.ArgumentParser(prog="tfdist-launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_workers", type=int, default=2, help="Worker tasks (default 2).")
    parser.add_argument("--num_ps", type=int, default=0, help="Parameter-server tasks (adds a chief task).")
    parser.add_argument("--print_tf_config", action="store_true",
                        help="Print the TF_CONFIG of every task and exit (for Kubernetes/SLURM job files).")
    parser.add_argument("--hosts", default="",
                        help="With --print_tf_config: comma-separated host:port per task, chief first, then "
                             "workers, then ps (default: localhost:2222, localhost:2223, ...).")
    parser.add_argument("--network", choices=("isolated", "host"), default="isolated",
                        help="isolated (default): run the tasks in a private network namespace, so their ports "
                             "are reachable only from this job; host: use this machine's network (needed when "
                             "tasks must reach the internet, e.g. tfds --download).")
    parser.add_argument("--restart_workers", type=int, default=0,
                        help="Parameter-server jobs: restart a worker that dies up to N times (it rejoins).")
    parser.add_argument("--grace_s", type=float, default=15.0,
                        help="Seconds the other tasks get to exit after one fails, before SIGKILL.")
    return parser.parse_args(own), command


def main(argv: list[str]) -> int:
    args, command = parse_args(argv)
    layout = ClusterLayout(args.num_workers, args.num_ps, chief=args.num_ps > 0).validate()
    if args.restart_workers < 0:
        raise UserError(f"--restart_workers={args.restart_workers} must be 0 or more.")
    if args.print_tf_config:
        roles = layout.roles()
        hosts = [h.strip() for h in args.hosts.split(",") if h.strip()] or \
            [f"localhost:{2222 + i}" for i in range(len(roles))]
        from tfdist import cluster as cluster_lib

        spec = cluster_spec(layout, hosts)
        for role, index in roles:
            value = tf_config(spec, role, index)
            cluster_lib.parse_tf_config(value)  # The same validation the tasks will apply.
            print(f"# {role} {index}\nTF_CONFIG='{value}'")
        return 0
    if not command:
        raise UserError("No command to launch; put it after --, e.g. "
                        "tfdist-launch --num_workers=2 -- tfdist-train --strategy=multi_worker_mirrored.")
    if args.network == "isolated":
        try:
            isolate_network()
            print("tfdist-launch: the tasks share a private network namespace; their ports are reachable only "
                  "from this job.", flush=True)
        except OSError as e:
            print(f"tfdist-launch: warning: could not create a private network namespace ({e}); the tasks use "
                  "this machine's network, where TensorFlow's servers listen on all interfaces for the job's "
                  "ports. Run on a trusted network or behind a firewall (--network=host silences this).",
                  file=sys.stderr, flush=True)
    if args.num_ps == 0 and any(arg in ("--strategy=parameter_server", "parameter_server") for arg in command):
        raise UserError("--strategy=parameter_server needs parameter servers: give --num_ps=1 or more.")
    return Launcher(command, layout, grace_s=args.grace_s, restart_workers=args.restart_workers).run()


def run() -> None:
    code = common.run_reporting_user_errors("tfdist-launch", lambda: main(sys.argv[1:]))
    sys.exit(code or 0)


if __name__ == "__main__":
    run()
