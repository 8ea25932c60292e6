"""The whole test suite, in the two environments tfdist supports.

  python3 -m pip install nox && python3 -m nox      # what README and .ci/run use

Sessions:
  tests-tf2.21          TensorFlow 2.21 (the primary target), Keras 3.
  tests-tf2.18-horovod  TensorFlow 2.18 + horovod 0.28.1 built from source with
                        Gloo (the newest TensorFlow horovod still builds against);
                        the Horovod tests run here for real.
Pass pytest arguments after --, e.g. `python3 -m nox -s tests-tf2.21 -- -k cluster`.
"""

import os

import nox

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


@nox.session(name="tests-tf2.21")
def tests_tf221(session: nox.Session) -> None:
    session.install("tensorflow==2.21.0", "-e", ".[test,bench]")
    session.run(*PYTEST, *session.posargs)


@nox.session(name="tests-tf2.18-horovod")
def tests_tf218_horovod(session: nox.Session) -> None:
    # tensorflow-metadata >= 1.17 needs protobuf >= 6, which TensorFlow 2.18 excludes.
    session.install("tensorflow==2.18.1", "tensorflow-metadata<1.17", "-e", ".[test]")
    session.install("setuptools>=65,<81", "wheel")  # horovod builds with the machine's cmake and g++.
    session.install("--no-build-isolation", "horovod==0.28.1", env=HOROVOD_BUILD_ENV)
    session.run("python", "-c", "import horovod.tensorflow as h; assert h.gloo_built(), 'horovod built without Gloo'")
    session.run(*PYTEST, *session.posargs, env={"TFDIST_REQUIRE_HOROVOD": "1"})
