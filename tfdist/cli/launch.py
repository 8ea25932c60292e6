"""tfdist-launch: start a multi-process job here or over SSH, or print its TF_CONFIGs or a TFJob.

  tfdist-launch --num_workers=2 -- tfdist-train --strategy=multi_worker_mirrored --workdir=W
  tfdist-launch --hosts=node1,node2 -- tfdist-train --strategy=multi_worker_mirrored --workdir=/shared/W
  tfdist-launch --hostfile=hosts.txt --max_restarts=3 -- tfdist-train --workdir=/shared/W
  tfdist-launch --num_workers=4 --min_workers=2 --max_restarts=3 -- tfdist-train --workdir=/shared/W
  tfdist-launch --print_tf_config --hosts=node1,node2 --port=2222
  tfdist-launch --print_tfjob --image=IMAGE --num_workers=2 -- tfdist-train --workdir=/shared/runs/mw

Without --hosts every task gets a free loopback port and its own TF_CONFIG, in a
private network namespace. With --hosts (HOST[:SLOTS], the number of tasks on
each host) or --hostfile (lines 'HOST slots=N'), each task starts on its host
through ssh, on a port checked free there. Output lines are prefixed with the
task's role and index; SIGINT/SIGTERM are forwarded; when one task fails the
others are stopped and the launcher exits with the failing task's status and
shows its last lines, or, with --max_restarts=N, relaunches the whole job --
with --min_workers=M too, on the workers left after dropping the failed one.
Several tasks on this machine split its cores (OMP_NUM_THREADS, TF_NUM_INTRAOP_THREADS,
TF_NUM_INTEROP_THREADS; --threads_per_task).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from tfdist.launcher import elastic, shaping, threads
from tfdist.launcher import hosts as hosts_lib
from tfdist.cli import common
from tfdist.errors import UserError
from tfdist.launcher.launch import ClusterLayout, Launcher, cluster_spec, isolate_network, tf_config
from tfdist.launcher.ssh import SshConfig


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1:]
    else:
        own, command = argv, []
    parser = argparse.ArgumentParser(prog="tfdist-launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_workers", type=int, default=None,
                        help="Worker tasks (default 2; with --hosts/--hostfile: the slots left after the chief "
                             "and ps tasks).")
    parser.add_argument("--num_ps", type=int, default=0, help="Parameter-server tasks (adds a chief task).")
    parser.add_argument("--hosts", default=None,
                        help="Comma-separated HOST[:SLOTS]: the machines and how many tasks each runs (default 1); "
                             "tasks fill them in order, chief first, then workers, then ps.")
    parser.add_argument("--hostfile", default=None, help="A file of 'HOST slots=N' lines, instead of --hosts.")
    parser.add_argument("--port", type=int, default=None,
                        help="First task port on each host (the next task on that host gets the next port). "
                             "Default: with --print_tf_config 2222; otherwise free ports chosen on each host.")
    parser.add_argument("--ssh_port", type=int, default=None, help="Port of the hosts' SSH servers (default 22).")
    parser.add_argument("--ssh_identity", default=None, help="Private key file for ssh -i.")
    parser.add_argument("--ssh_option", action="append", default=[],
                        help="Extra ssh -o option, e.g. --ssh_option=StrictHostKeyChecking=accept-new (repeatable).")
    parser.add_argument("--env", action="append", default=[],
                        help="NAME (its value here) or NAME=VALUE: set in every task's environment (repeatable). "
                             "Over ssh this and TF_CONFIG are all the tasks get from here.")
    parser.add_argument("--print_tf_config", action="store_true",
                        help="Print the TF_CONFIG of every task and exit (for SLURM or hand-made job files).")
    parser.add_argument("--print_tfjob", action="store_true",
                        help="Print a Kubeflow TFJob manifest (YAML) running the command and exit; needs --image.")
    parser.add_argument("--image", default=None, help="With --print_tfjob: the container image.")
    parser.add_argument("--job_name", default="tfdist", help="With --print_tfjob: the TFJob's name.")
    parser.add_argument("--network", choices=("isolated", "host"), default=None,
                        help="isolated (default without --hosts): run the tasks in a private network namespace, so "
                             "their ports are reachable only from this job; host: use this machine's network (needed "
                             "when tasks must reach the internet, e.g. tfds --download, and always with --hosts).")
    parser.add_argument("--link_rate", default=None,
                        help="Local launches: shape the job's private loopback to this rate (tc tbf), e.g. 1gbit or "
                             "200mbit, to measure a communication-bound job on one machine. Needs the isolated "
                             "network and tc (iproute2).")
    parser.add_argument("--restart_workers", type=int, default=0,
                        help="Parameter-server jobs: restart a worker that dies up to N times (it rejoins).")
    parser.add_argument("--max_restarts", type=int, default=0,
                        help="When the job fails, stop it and relaunch all of it, with the same command, up to N "
                             "times (tfdist-train resumes from its --workdir). 0: no restarts.")
    parser.add_argument("--min_workers", type=int, default=None,
                        help="Elastic: when a worker fails, relaunch on the workers left (dropping a slot, or with "
                             "--hosts its host, after --blacklist_after failures) while at least this many remain; "
                             "--num_workers is the most. Each relaunch uses one of --max_restarts.")
    parser.add_argument("--blacklist_after", type=int, default=1,
                        help="Elastic: failures of one worker slot (with --hosts: one host) before it is dropped "
                             "(default 1).")
    parser.add_argument("--restart_backoff_s", type=float, default=10.0,
                        help="Seconds to wait before each relaunch (default 10).")
    parser.add_argument("--grace_s", type=float, default=15.0,
                        help="Seconds the other tasks get to exit after one fails, before SIGKILL.")
    parser.add_argument("--threads_per_task", default="auto",
                        help="auto (default): when several tasks start on this machine, split its cores between "
                             "them: each gets OMP_NUM_THREADS and TF_NUM_INTRAOP_THREADS = cores // tasks (at least "
                             "1) and TF_NUM_INTEROP_THREADS = the same, at least 2 (tasks started over ssh are left "
                             "as they are); N: N threads per task, on every host; off: set nothing (TensorFlow's "
                             "defaults). A variable already set here or with --env is kept.")
    return parser.parse_args(own), command


def read_hosts(args: argparse.Namespace) -> Optional[list[hosts_lib.Host]]:
    if args.hosts is not None and args.hostfile is not None:
        raise UserError("Give either --hosts or --hostfile, not both.")
    if args.hosts is not None:
        return hosts_lib.parse_hosts(args.hosts)
    if args.hostfile is not None:
        return hosts_lib.parse_hostfile(args.hostfile)
    return None


def task_env(specs: list[str]) -> dict[str, str]:
    """--env=NAME / --env=NAME=VALUE -> {NAME: VALUE}."""
    env = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not name.isidentifier():
            raise UserError(f"--env={spec!r}: {name!r} is not a variable name; write --env=NAME or --env=NAME=VALUE.")
        if not sep:
            if name not in os.environ:
                raise UserError(f"--env={name} passes this shell's {name}, which is not set; set it or write "
                                f"--env={name}=VALUE.")
            value = os.environ[name]
        env[name] = value
    return env


def layout_from(args: argparse.Namespace, hosts: Optional[list[hosts_lib.Host]]) -> ClusterLayout:
    num_workers = args.num_workers
    if num_workers is None:
        extra = args.num_ps + (1 if args.num_ps > 0 else 0)
        num_workers = sum(h.slots for h in hosts) - extra if hosts else 2
    return ClusterLayout(num_workers, args.num_ps, chief=args.num_ps > 0).validate()


def check_command(command: list[str], num_ps: int) -> None:
    if num_ps == 0 and any(arg in ("--strategy=parameter_server", "parameter_server") for arg in command):
        raise UserError("--strategy=parameter_server needs parameter servers: give --num_ps=1 or more.")


def _check_numbers(args: argparse.Namespace, num_workers: int) -> None:
    """The restart, elastic and port flags' own refusals."""
    if args.restart_workers < 0:
        raise UserError(f"--restart_workers={args.restart_workers} must be 0 or more.")
    if args.max_restarts < 0:
        raise UserError(f"--max_restarts={args.max_restarts} must be 0 or more (0: no restarts).")
    elastic.validate(num_workers, args.min_workers, num_ps=args.num_ps, max_restarts=args.max_restarts,
                     blacklist_after=args.blacklist_after)
    if args.restart_backoff_s < 0:
        raise UserError(f"--restart_backoff_s={args.restart_backoff_s} must be 0 or more.")
    if args.port is not None and not 0 <= args.port <= 65535:
        raise UserError(f"--port={args.port} must be a port number, 1-65535 (or 0: free ports).")
    threads.parse(args.threads_per_task)


def main(argv: list[str]) -> int:
    args, command = parse_args(argv)
    hosts = read_hosts(args)
    layout = layout_from(args, hosts)
    _check_numbers(args, layout.num_workers)
    env = task_env(args.env)
    if args.print_tfjob:
        from tfdist.launcher import tfjob

        check_command(command, args.num_ps)
        manifest = tfjob.tfjob_manifest(name=args.job_name, image=args.image or "", command=command,
                                        num_workers=layout.num_workers, num_ps=args.num_ps)
        print(tfjob.manifest_text(manifest), end="")
        return 0
    if args.print_tf_config:
        from tfdist.distribute import cluster as cluster_lib

        roles = layout.roles()
        placement = hosts_lib.place(hosts or [hosts_lib.Host("localhost", len(roles))], len(roles))
        spec = cluster_spec(layout, hosts_lib.addresses(placement, 2222 if args.port is None else args.port))
        for role, index in roles:
            value = tf_config(spec, role, index)
            cluster_lib.parse_tf_config(value)  # The same validation the tasks will apply.
            print(f"# {role} {index}\nTF_CONFIG='{value}'")
        return 0
    if not command:
        raise UserError("No command to launch; put it after --, e.g. "
                        "tfdist-launch --num_workers=2 -- tfdist-train --strategy=multi_worker_mirrored.")
    check_command(command, args.num_ps)
    if args.max_restarts and any(a in ("tfdist-train", "tfdist.cli.train") for a in command) and not any(
            a.startswith(("--workdir", "--flagfile")) for a in command):
        raise UserError(f"--max_restarts={args.max_restarts} relaunches the same command, and tfdist-train without "
                        "--workdir starts a new run directory each time, so a relaunch would start over; give "
                        "tfdist-train --workdir=DIR (a shared path across hosts).")
    if args.min_workers is not None:
        elastic.check_global_batch(command, layout.num_workers, args.min_workers)
    rate = shaping.parse_rate(args.link_rate) if args.link_rate is not None else None
    if rate is not None and (hosts is not None or args.network == "host"):
        raise UserError("--link_rate shapes the private loopback of a local launch; with --hosts or --network=host "
                        "the tasks use real network links, which tfdist-launch does not shape. Leave --link_rate "
                        "out there (shape those links with tc on the hosts themselves).")
    if hosts is not None:
        if args.network == "isolated":
            raise UserError("--network=isolated cannot be used with --hosts/--hostfile: the tasks run on other "
                            "machines and reach each other over their network. Leave --network out.")
        ssh = SshConfig(port=args.ssh_port, identity=args.ssh_identity, options=tuple(args.ssh_option))
        ssh.ssh_argv(hosts[0].name)  # The ssh client exists.
        if args.ssh_identity and not os.path.isfile(args.ssh_identity):
            raise UserError(f"--ssh_identity={args.ssh_identity!r} does not exist; give the private key file.")
        if args.min_workers is not None:
            elastic.check_shared_workdir(ssh.run, hosts_lib.place(hosts, layout.num_workers),
                                         elastic.flag_value(command, "workdir"))
        return Launcher(command, layout, grace_s=args.grace_s, restart_workers=args.restart_workers, task_env=env,
                        hosts=hosts, ssh=ssh, base_port=args.port or 0, max_restarts=args.max_restarts,
                        restart_backoff_s=args.restart_backoff_s, min_workers=args.min_workers,
                        blacklist_after=args.blacklist_after, threads_per_task=args.threads_per_task).run()
    if args.network != "host":
        try:
            isolate_network()
            print("tfdist-launch: the tasks share a private network namespace; their ports are reachable only "
                  "from this job.", flush=True)
        except OSError as e:
            if rate is not None:
                raise UserError(f"--link_rate needs the job's private network namespace, which this machine does not "
                                f"allow ({e}); leave --link_rate out.") from None
            print(f"tfdist-launch: warning: could not create a private network namespace ({e}); the tasks use "
                  "this machine's network, where TensorFlow's servers listen on all interfaces for the job's "
                  "ports. Run on a trusted network or behind a firewall (--network=host silences this).",
                  file=sys.stderr, flush=True)
    if rate is not None:
        print(f"tfdist-launch: the job's loopback is shaped to {args.link_rate} ({shaping.shape_loopback(rate)}).",
              flush=True)
    return Launcher(command, layout, grace_s=args.grace_s, restart_workers=args.restart_workers, task_env=env,
                    base_port=args.port or 0, max_restarts=args.max_restarts,
                    restart_backoff_s=args.restart_backoff_s, min_workers=args.min_workers,
                    blacklist_after=args.blacklist_after, threads_per_task=args.threads_per_task).run()


def run() -> None:
    code = common.run_reporting_user_errors("tfdist-launch", lambda: main(sys.argv[1:]))
    sys.exit(code or 0)


if __name__ == "__main__":
    run()
