"""A real S3 API on loopback: moto's standalone server (`python -m moto.server`) as a child process.

Used by the object-store tests and benchmark (moto is a dev dependency). The server speaks the S3 HTTP
API that s3fs and botocore use against AWS; only the endpoint URL and throwaway credentials differ,
passed the way users pass theirs: `environment()` gives EAGLE_TAP_S3_ENDPOINT_URL and the AWS_* variables.
A stopped server forgets its buckets; a server started on the port of a stopped one is a fresh store.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from eagle_tap.serve.sglang_server import free_port

__all__ = ["S3Server", "s3_environment"]


def s3_environment(endpoint_url: str) -> dict[str, str]:
    """What a collector or trainer needs in its environment to use the S3 server at endpoint_url."""
    return {
        "EAGLE_TAP_S3_ENDPOINT_URL": endpoint_url,
        "AWS_ACCESS_KEY_ID": "eagle-tap-test",
        "AWS_SECRET_ACCESS_KEY": "eagle-tap-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


class S3Server:
    """moto's S3 server on 127.0.0.1:port (a free port by default); `start()` returns once it answers."""

    def __init__(self, port: int | None = None, log_path: Path | None = None) -> None:
        self.port = port or free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def environment(self) -> dict[str, str]:
        return s3_environment(self.endpoint_url)

    def start(self, timeout_s: float = 60.0) -> S3Server:
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **self.environment()})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto's S3 server exited with {self.process.returncode}"
                                   f"{f': see {self.log_path}' if self.log_path else ''}")
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=2):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto's S3 server did not answer on {self.endpoint_url} within {timeout_s:.0f} s")

    def create_bucket(self, bucket: str) -> None:
        """Creates bucket through the S3 API (as `aws s3 mb` would)."""
        import boto3  # moto's own dependency

        environment = self.environment()
        boto3.client("s3", endpoint_url=self.endpoint_url, region_name=environment["AWS_DEFAULT_REGION"],
                     aws_access_key_id=environment["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=environment["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket=bucket)

    def stop(self) -> None:
        """Ends the server (and with it every bucket); safe to call twice."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
