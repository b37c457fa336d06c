"""A real S3-compatible server for the storage tests: moto's server mode (``moto[server]``, the
``test`` extra), started by the test as a subprocess on 127.0.0.1 on a free port. Nothing
leaves the machine: the endpoint, region and credentials are set through the usual AWS
environment variables, which pyarrow, botocore and Ray's workers (started after them) read."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """``python -m moto.server`` on 127.0.0.1. ``auth=True``: every request is authenticated
    against moto's (empty) IAM, so any access key is unknown (the missing-credentials case)."""

    def __init__(self, auth: bool = False) -> None:
        self.port = free_port()
        env = dict(os.environ)
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                      "-p", str(self.port)], env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() - t0 > 60:
                    raise RuntimeError("moto server did not start")
                time.sleep(0.1)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What a user sets for an S3-compatible endpoint (no real AWS account involved)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self):
        import botocore.session
        e = self.env()
        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, region_name=e["AWS_DEFAULT_REGION"],
            aws_access_key_id=e["AWS_ACCESS_KEY_ID"], aws_secret_access_key=e["AWS_SECRET_ACCESS_KEY"])

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key under ``prefix`` (what is really stored), without the empty
        ``folder/`` markers pyarrow keeps for folders."""
        out, token = [], None
        c = self.client()
        while True:
            kw = {"Bucket": bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
            r = c.list_objects_v2(**kw)
            out += [o["Key"] for o in r.get("Contents", []) if not o["Key"].endswith("/")]
            if not r.get("IsTruncated"):
                return sorted(out)
            token = r["NextContinuationToken"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class EnvVars:
    """Set environment variables for a block (module fixtures), restoring them after."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values, self.old = values, {}

    def __enter__(self) -> "EnvVars":
        for k, v in self.values.items():
            self.old[k] = os.environ.get(k)
            os.environ[k] = v
        return self

    def __exit__(self, *exc: object) -> None:
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
