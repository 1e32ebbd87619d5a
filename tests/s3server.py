"""A real S3-compatible server on 127.0.0.1 for the tests (moto's server mode, as s3fs's own tests run it),
behind a small proxy of the test's own that can answer 500s, stall, cut a body short or drop connections:
faults of a real server's, injected on the wire, with the client (obstore) untouched."""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BUCKET = "adapters"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Faults:
    """What the proxy does to requests whose path contains `match` (every request where match is ""):
    mode None (forward), "500", "slow" (wait `seconds` first), "truncate" (half the body, then close),
    "down" (close without an answer), "stall" (half the body, then `seconds` of nothing, then the rest),
    "trickle" (the body in eight pieces, `seconds` apart), "no-if-match" (forwarded without its If-Match, as a
    server or cache that ignores it answers); only requests of `method` where one is given ("GET": the
    downloads, not the HEADs that pin). gets counts the GETs of objects forwarded whole."""

    def __init__(self) -> None:
        self.mode: str | None = None
        self.match = ""
        self.method: str | None = None
        self.seconds = 0.0
        self.gets = 0
        self.hook = None  # called (no arguments) as a request it matches arrives, before anything is done to it


def serving(timeout: str):
    """A test module's server fixture's body: the proxy's faults while both serve, under the object timeout
    given (MSTAR_LORA_OBJECT_TIMEOUT), then both stopped."""
    moto, proxy, faults, _ = start({"MSTAR_LORA_OBJECT_TIMEOUT": timeout})
    yield faults
    proxy.shutdown()
    moto.stop()


def start(env: dict[str, str] | None = None) -> tuple[object, ThreadingHTTPServer, Faults, str]:
    """(moto's server, the proxy, its faults, the proxy's URL), both serving on 127.0.0.1."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    faults = Faults()

    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            hit = faults.mode is not None and faults.match in self.path and faults.method in (None, self.command)
            if hit and faults.hook is not None:
                faults.hook()
            if hit and faults.mode == "down":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if hit and faults.mode == "500":
                self.send_response(500)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if hit and faults.mode == "slow":
                time.sleep(faults.seconds)
            headers = {k: v for k, v in self.headers.items()
                       if not (hit and faults.mode == "no-if-match" and k.lower() == "if-match")}
            upstream = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            upstream.request(self.command, self.path, body, headers)
            answer = upstream.getresponse()
            data = answer.read()
            self.send_response(answer.status)
            for k, v in answer.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            # a HEAD's answer has no body, and its Content-Length is the object's size
            self.send_header("Content-Length", answer.getheader("Content-Length", "0") if self.command == "HEAD"
                             else str(len(data)))
            self.end_headers()
            if hit and faults.mode == "truncate" and self.command == "GET" and len(data) > 1:
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if self.command == "GET" and answer.status == 200 and "list-type" not in self.path:
                faults.gets += 1
            if hit and faults.mode in ("stall", "trickle") and self.command == "GET" and len(data) > 8:
                pieces = [data[: len(data) // 2], data[len(data) // 2:]] if faults.mode == "stall" else \
                    [data[i * len(data) // 8:(i + 1) * len(data) // 8] for i in range(8)]
                for i, piece in enumerate(pieces):
                    if i:
                        time.sleep(faults.seconds)
                    try:
                        self.wfile.write(piece)
                        self.wfile.flush()
                    except OSError:  # the client gave up meanwhile
                        return
                return
            self.wfile.write(data)

        do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = forward

    proxy = ThreadingHTTPServer(("127.0.0.1", free_port()), Proxy)
    proxy.daemon_threads = True
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{proxy.server_address[1]}"
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1",
                      AWS_ENDPOINT_URL=url, AWS_ALLOW_HTTP="true", **(env or {}))
    import boto3

    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").create_bucket(Bucket=BUCKET)
    return moto, proxy, faults, url


def upload(folder, prefix: str) -> None:
    """A PEFT adapter folder's files put under prefix/ in the bucket."""
    import boto3

    s3 = boto3.client("s3")
    for f in sorted(os.listdir(folder)):
        if f == "adapter_config.json" or f.endswith(".safetensors"):
            with open(os.path.join(folder, f), "rb") as fh:
                s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{f}", Body=fh.read())
