"""The TPU backend: find the TPU, connect, initialise it, then build TPUStrategy.

TensorFlow requires this order: a `TPUClusterResolver`; for a remote TPU (a
TPU name or a ``grpc://`` address) `tf.config.experimental_connect_to_cluster`;
`tf.tpu.experimental.initialize_tpu_system`; only then `TPUStrategy`. The
TensorFlow calls go through a `TPUCalls` object so tests can check the sequence
and its arguments precisely without a TPU.

Without a TPU the backend fails fast: ``--tpu=local`` first looks for a TPU on
the PCI bus (Google's vendor id 0x1ae0 *and* a TPU device id: the same vendor
id also marks gVNIC, the virtual NIC most GCE VMs have), and every
TensorFlow step runs under a deadline, so an unreachable or misspelled TPU
becomes a clear error within ``TPU_INIT_TIMEOUT_S`` seconds, never a hang.
"""

from __future__ import annotations

import glob
import os
import socket
import threading
from typing import Any, Callable, Mapping, Optional

from tfdist.errors import UserError

GOOGLE_PCI_VENDOR = "0x1ae0"
# PCI device ids of Google's TPU chips (as JAX's hardware_utils lists them).
# Other devices of the same vendor, e.g. gVNIC (0x0042), are not TPUs.
TPU_PCI_DEVICES = {
    "0x0027": "TPU v2/v3",
    "0x005e": "TPU v4",
    "0x0062": "TPU v5p",
    "0x0063": "TPU v5e",
    "0x006f": "TPU v6e",
    "0x0076": "TPU 7x",
}
PCI_DEVICES_DIR = "/sys/bus/pci/devices"
TPU_INIT_TIMEOUT_S = 45.0


def _read_id(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip().lower()
    except OSError:
        return None


def local_tpu_devices(sysfs: str = PCI_DEVICES_DIR) -> list[str]:
    """The PCI addresses of this machine's TPU chips (Google vendor id and a TPU device id)."""
    found = []
    for device_dir in sorted(glob.glob(os.path.join(sysfs, "*"))):
        if _read_id(os.path.join(device_dir, "vendor")) != GOOGLE_PCI_VENDOR:
            continue
        if _read_id(os.path.join(device_dir, "device")) in TPU_PCI_DEVICES:
            found.append(os.path.basename(device_dir))
    return found


def tpu_detected(environ: Optional[Mapping[str, str]] = None, sysfs: str = PCI_DEVICES_DIR) -> bool:
    """Whether `--strategy=auto` should pick the TPU: TPU_NAME is set, or a TPU chip is on the PCI bus."""
    environ = os.environ if environ is None else environ
    return bool(environ.get("TPU_NAME")) or bool(local_tpu_devices(sysfs))


class TPUCalls:
    """The TensorFlow calls the TPU backend makes, in one replaceable place."""

    def resolver(self, tpu: str, zone: Optional[str], project: Optional[str]) -> Any:
        import tensorflow as tf

        return tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu, zone=zone, project=project)

    def connect_to_cluster(self, resolver: Any) -> None:
        import tensorflow as tf

        tf.config.experimental_connect_to_cluster(resolver)

    def initialize_tpu_system(self, resolver: Any) -> Any:
        import tensorflow as tf

        return tf.tpu.experimental.initialize_tpu_system(resolver)

    def tpu_strategy(self, resolver: Any) -> Any:
        import tensorflow as tf

        return tf.distribute.TPUStrategy(resolver)


def _how_to_point(tpu: str) -> str:
    return (
        "Point tfdist at a TPU with --tpu=local on a TPU VM, --tpu=NAME (with --tpu_zone and --gcp_project "
        "when they are not the VM's own) for a Cloud TPU node, or --tpu=grpc://HOST:8470."
    )


def _with_deadline(what: str, tpu: str, fn: Callable[[], Any], timeout_s: float) -> Any:
    """Runs one TensorFlow step; a step that does not return in time is an error, not a hang."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # Re-raised in the caller's thread.
            result["error"] = e

    thread = threading.Thread(target=target, name=f"tfdist-tpu-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise UserError(
            f"No TPU answered at --tpu={tpu}: {what} did not finish within {timeout_s:.0f} s. Check that the "
            f"TPU exists, is READY and is reachable from this machine. {_how_to_point(tpu)}"
        )
    if "error" in result:
        error = result["error"]
        message = " ".join(str(error).split())[:300]
        raise UserError(
            f"No TPU was found at --tpu={tpu}: {what} failed ({type(error).__name__}: {message}). "
            f"{_how_to_point(tpu)}"
        ) from None
    return result.get("value")


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    host, _, port = address[len("grpc://"):].rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--tpu={address} is not a grpc://HOST:PORT address, e.g. grpc://10.0.0.2:8470.")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise UserError(
            f"No TPU was found at --tpu={address}: nothing answered at {host}:{port} ({e.strerror or e}). "
            f"{_how_to_point(address)}"
        ) from None


def connect(tpu: str, *, zone: Optional[str] = None, project: Optional[str] = None,
            calls: Optional[TPUCalls] = None, timeout_s: float = TPU_INIT_TIMEOUT_S,
            sysfs: str = PCI_DEVICES_DIR) -> Any:
    """Resolves, connects to and initialises the TPU; returns the TPUStrategy."""
    calls = calls or TPUCalls()
    if tpu == "local" and not local_tpu_devices(sysfs):
        raise UserError(
            "No TPU was found on this machine: --tpu=local looks for the TPU chips of a TPU VM (PCI vendor "
            f"{GOOGLE_PCI_VENDOR} with a TPU device id) in {sysfs} and there are none. {_how_to_point(tpu)}"
        )
    if tpu.startswith("grpc://"):
        _check_reachable(tpu)
    resolver = _with_deadline("resolving the TPU", tpu, lambda: calls.resolver(tpu, zone, project), timeout_s)
    if tpu != "local":  # A TPU VM's chips are local; a TPU node is reached over gRPC.
        _with_deadline("connecting to the TPU cluster", tpu, lambda: calls.connect_to_cluster(resolver), timeout_s)
    _with_deadline("initialising the TPU system", tpu, lambda: calls.initialize_tpu_system(resolver), timeout_s)
    return calls.tpu_strategy(resolver)
