"""Ceph's RADOS Gateway on 127.0.0.1: a second, real S3 server for the S3 tests.

A one-monitor cluster with one in-memory OSD (``memstore``, pool size 1, no cephx) and
one ``radosgw`` with the beast frontend, all children of this process, in a temporary
directory; :meth:`RadosGateway.stop` ends them by their PIDs and removes the directory.
It starts in seconds.  Needs Debian's ``radosgw ceph-mon ceph-osd`` (Ceph 16):
``scripts/test_rgw.sh`` installs them when missing.

Facts this depends on (Ceph 16.2): there is no standalone database backend, so it takes
a monitor and an OSD; ``ms_mon_client_mode = crc secure`` is needed or radosgw waits
300 s for authentication; a user with fixed keys comes from ``radosgw-admin user
create``.  Unlike moto it checks every request's SigV4 signature.

``python -m tests.rgw -- CMD...`` starts a gateway, runs ``CMD`` with
``RAYCHECKPOINT_TEST_S3_ENDPOINT`` / ``_KEY`` / ``_SECRET`` set to it, and stops it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from workers.group import free_port

BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph")
START_TIMEOUT_S = int(os.environ.get("RGW_START_TIMEOUT_S", "120"))


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


class RadosGateway:
    """A throwaway Ceph cluster serving S3 on ``endpoint`` (see the module doc)."""

    def __init__(self) -> None:
        missing = missing_binaries()
        if missing:
            raise RuntimeError(f"Ceph's RADOS Gateway needs {', '.join(missing)} "
                               "(Debian packages radosgw ceph-mon ceph-osd)")
        self.dir = Path(tempfile.mkdtemp(prefix="rcrgw-", dir="/tmp"))
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.key = "RC" + secrets.token_hex(9).upper()
        self.secret = secrets.token_urlsafe(30)
        self.procs: list[subprocess.Popen] = []
        self.conf = self.dir / "ceph.conf"

    # ---- start --------------------------------------------------------------------------

    def start(self) -> RadosGateway:
        try:
            self._configure()
            self._start_mon()
            self._start_osd()
            self._start_rgw()
            self._run("radosgw-admin", "user", "create", "--uid=raycheckpoint",
                      "--display-name=raycheckpoint", f"--access-key={self.key}",
                      f"--secret-key={self.secret}")
        except BaseException:
            self.stop()
            raise
        return self

    def _configure(self) -> None:
        d = self.dir
        for sub in ("mon/ceph-a", "osd/ceph-0", "run", "log", "rgw"):
            (d / sub).mkdir(parents=True)
        self.mon_port = free_port()
        self.fsid = str(uuid.uuid4())
        self.conf.write_text(f"""[global]
fsid = {self.fsid}
mon_host = [v2:127.0.0.1:{self.mon_port}]
ms_bind_ipv4 = true
ms_bind_ipv6 = false
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
public_network = 127.0.0.0/8
ms_mon_client_mode = crc secure
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
run_dir = {d}/run
admin_socket = {d}/run/$name.asok
pid_file = {d}/run/$name.pid
log_file = {d}/log/$name.log
mon_data = {d}/mon/$cluster-$id
osd_data = {d}/osd/$cluster-$id
keyring = {d}/keyring
osd_objectstore = memstore
memstore_device_bytes = 4294967296
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
osd_crush_chooseleaf_type = 0
mon_osd_down_out_interval = 0
rgw_data = {d}/rgw
rgw_frontends = beast endpoint=127.0.0.1:{self.port}
rgw_enable_usage_log = false
rgw_dns_name = 127.0.0.1
""")
        self._run("ceph-authtool", "--create-keyring", str(d / "keyring"), "--gen-key",
                  "-n", "mon.", "--cap", "mon", "allow *", conf=False)

    def _start_mon(self) -> None:
        monmap = self.dir / "monmap"
        self._run("monmaptool", "--create", "--addv", "a", f"[v2:127.0.0.1:{self.mon_port}]",
                  "--fsid", self.fsid, str(monmap), conf=False)
        self._run("ceph-mon", "--mkfs", "-i", "a", "--monmap", str(monmap))
        self._spawn("ceph-mon", "-f", "-i", "a")
        self._until(lambda: self._ok("ceph", "mon", "stat"), "the monitor to answer")

    def _start_osd(self) -> None:
        osd_id = self._run("ceph", "osd", "create").strip()
        self._run("ceph-osd", "--mkfs", "-i", osd_id)
        self._spawn("ceph-osd", "-f", "-i", osd_id)
        self._until(lambda: "1 up" in self._run("ceph", "osd", "stat"), "the OSD to come up")

    def _start_rgw(self) -> None:
        self._spawn("radosgw", "-f", "-n", "client.rgw")

        def answers() -> bool:
            try:
                with urllib.request.urlopen(self.endpoint, timeout=5):
                    return True
            except urllib.error.HTTPError:
                return True  # any HTTP answer: the frontend is up
            except OSError:
                return False

        self._until(answers, "radosgw to answer HTTP")

    # ---- helpers ------------------------------------------------------------------------

    def _args(self, cmd: str, args: tuple[str, ...], conf: bool) -> list[str]:
        return [cmd, *(["-c", str(self.conf)] if conf else []), *args]

    def _run(self, cmd: str, *args: str, conf: bool = True, timeout: float = 60) -> str:
        out = subprocess.run(self._args(cmd, args, conf), capture_output=True, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL)
        if out.returncode:
            raise RuntimeError(f"{cmd} {' '.join(args)} failed ({out.returncode}): "
                               f"{(out.stderr or out.stdout)[-1500:]}\n{self._logs()}")
        return out.stdout

    def _ok(self, *cmd: str) -> bool:
        try:
            self._run(*cmd, timeout=10)
            return True
        except (RuntimeError, subprocess.TimeoutExpired):
            return False

    def _spawn(self, cmd: str, *args: str) -> None:
        log = open(self.dir / "log" / f"{cmd}.out", "wb")  # noqa: SIM115 - closed with the process
        self.procs.append(subprocess.Popen(self._args(cmd, args, True), stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        log.close()

    def _until(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"{START_TIMEOUT_S} s passed"
                raise RuntimeError(f"waiting for {what}: {why}\n{self._logs()}")
            time.sleep(0.5)

    def _logs(self) -> str:
        tails = []
        for p in sorted((self.dir / "log").glob("*")):
            text = p.read_text(errors="replace")[-800:]
            if text.strip():
                tails.append(f"--- {p.name}\n{text}")
        return "\n".join(tails)

    # ---- stop ---------------------------------------------------------------------------

    def stop(self) -> None:
        for p in reversed(self.procs):  # gateway, OSD, monitor
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=20)
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def version(self) -> str:
        return self._run("radosgw", "--version", conf=False).split("(")[0].strip()

    def env(self) -> dict[str, str]:
        return {"RAYCHECKPOINT_TEST_S3_KIND": f"Ceph RADOS Gateway ({self.version()})",
                "RAYCHECKPOINT_TEST_S3_ENDPOINT": self.endpoint,
                "RAYCHECKPOINT_TEST_S3_KEY": self.key,
                "RAYCHECKPOINT_TEST_S3_SECRET": self.secret}

    def __enter__(self) -> RadosGateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m tests.rgw -- CMD [ARG...]", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    with RadosGateway() as gw:
        print(f"RADOS Gateway at {gw.endpoint} (up in {time.monotonic() - t0:.1f} s)", flush=True)
        return subprocess.call(argv, env={**os.environ, **gw.env()})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
