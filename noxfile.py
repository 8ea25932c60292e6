"""The whole test suite, in the two environments tfdist supports.

  python3 -m pip install nox && python3 -m nox      # what README and .ci/run use

Sessions:
  tests-tf2.21          TensorFlow 2.21 (the primary target), Keras 3.
  tests-tf2.18-horovod  TensorFlow 2.18 + horovod 0.28.1 built from source with
                        Gloo (the newest TensorFlow horovod still builds against):
                        what differs there, i.e. the tests marked `horovod` (real
                        horovodrun jobs: tfdist-train, custom steps, evaluate and
                        predict, the keras.io examples, topology, the peer) and
                        those marked `keras_internals` (the TensorFlow/Keras
                        internals tfdist's step relies on), not `jobs`. Everything
                        else runs once, in tests-tf2.21.
  keras-conformance     not in the default sessions: Keras' own test files through tfdist in full
                        (tests/test_keras_conformance.py with KERAS_CONFORMANCE_SET=all). CI's
                        tests-tf2.21 runs the trainer/callback/adapter files whole and one test
                        of each of the 113 broad files (models, layers, optimizers, metrics,
                        saving, ...): tests/keras_conformance/sample.txt, each file's quickest
                        test that calls fit/evaluate/predict. This session runs every test (about an hour per mode on 2 busy cores; the
                        two modes run side by side) and checks the README's count.

CI's budget: `bash .ci/run` (both sessions, Horovod's build included) within 45 minutes on a
2-core machine (its hard limit is 90); measured 2026-12-04 from a clean clone: see the README.
Pass pytest arguments after --, e.g. `python3 -m nox -s tests-tf2.21 -- -k cluster`.

Both sessions first make sure an OpenSSH server (for tests/test_ssh.py) and tc
(for tests/test_shaping.py) are installed: as root, on a machine with apt-get
that lacks them, they install Debian's openssh-server and iproute2. Elsewhere
(not root, or the install fails) those tests skip and say why.
"""

import os
import shutil

import nox
from nox.command import CommandFailed

nox.options.sessions = ["tests-tf2.21", "tests-tf2.18-horovod"]
nox.options.error_on_missing_interpreters = True

PYTEST = ["pytest", "-n", "2", "--durations=15"]
HOROVOD_BUILD_ENV = {
    "HOROVOD_WITH_TENSORFLOW": "1",
    "HOROVOD_WITH_GLOO": "1",
    "HOROVOD_WITHOUT_MPI": "1",
    "HOROVOD_WITHOUT_PYTORCH": "1",
    "HOROVOD_WITHOUT_MXNET": "1",
    "MAKEFLAGS": f"-j{os.cpu_count() or 2}",
}


def ensure_sshd(session: nox.Session) -> None:
    """Installs what the SSH and link-shaping tests need, only as root and only if missing.

    openssh-server (sshd, ssh, ssh-keygen) for tests/test_ssh.py; iproute2 (tc) for tests/test_shaping.py.
    """
    packages = []
    if not (os.path.exists("/usr/sbin/sshd") and shutil.which("ssh") and shutil.which("ssh-keygen")):
        packages += ["openssh-server", "openssh-client"]
    if not (shutil.which("tc") or os.path.exists("/usr/sbin/tc") or os.path.exists("/sbin/tc")):
        packages.append("iproute2")
    if not packages:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        session.warn(f"{', '.join(packages)} missing here and no root/apt-get to install them: the tests that need "
                     "them (SSH, link shaping) will skip")
        return
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    try:
        session.run("apt-get", "update", "-q", external=True, env=env)
        session.run("apt-get", "install", "-y", "-q", "--no-install-recommends", *packages, external=True, env=env)
    except CommandFailed:
        session.warn(f"installing {', '.join(packages)} failed: the tests that need them will skip")


@nox.session(name="tests-tf2.21")
def tests_tf221(session: nox.Session) -> None:
    ensure_sshd(session)
    # tf_keras for the benchmark's peer programs (tests/test_peers.py), at the TensorFlow's own minor version.
    # keras pinned: tests/keras_conformance/known_failures.txt lists Keras 3.15.1's own test ids.
    session.install("tensorflow==2.21.0", "tf_keras==2.21.0", "keras==3.15.1", "-e", ".[test,bench]")
    session.run(*PYTEST, *session.posargs)


@nox.session(name="keras-conformance")
def keras_conformance(session: nox.Session) -> None:
    session.install("tensorflow==2.21.0", "keras==3.15.1", "-e", ".[test]")
    session.run("pytest", "-p", "no:xdist", "-v", "tests/test_keras_conformance.py", *session.posargs,
                env={"KERAS_CONFORMANCE_SET": "all"})


@nox.session(name="tests-tf2.18-horovod")
def tests_tf218_horovod(session: nox.Session) -> None:
    ensure_sshd(session)
    # tensorflow-metadata >= 1.17 needs protobuf >= 6, which TensorFlow 2.18 excludes.
    session.install("tensorflow==2.18.1", "tensorflow-metadata<1.17", "tf_keras==2.18.0", "-e", ".[test]")
    session.install("setuptools>=65,<81", "wheel")  # horovod builds with the machine's cmake and g++.
    session.install("--no-build-isolation", "horovod==0.28.1", env=HOROVOD_BUILD_ENV)
    session.run("python", "-c", "import horovod.tensorflow as h; assert h.gloo_built(), 'horovod built without Gloo'")
    # Only what differs on this TensorFlow: Horovod's tests, for real, and the Keras-internals checks. The rest
    # (the real multi-process jobs included) runs once, in tests-tf2.21: CI's 45-minute budget on 2 cores.
    session.run(*PYTEST, "-m", "horovod or (keras_internals and not jobs)", *session.posargs,
                env={"TFDIST_REQUIRE_HOROVOD": "1"})
