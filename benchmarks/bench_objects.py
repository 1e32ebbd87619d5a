"""An adapter's first use from object storage: from the request's first step to the step that admits it,
against a plain download of the same bytes with the same client.

Run: .venv/bin/python benchmarks/bench_objects.py [--runs 9]

A local S3 server (moto's server mode on 127.0.0.1) holds a Llama-7B-shaped adapter, rank 8 on q/k/v/o
(16.8 MB), under a new name each run. The manager's side: a request names it; the manager's resolver finds
it under the prefix, pins its objects (a HEAD of each of its two files), downloads it into a fresh disk
tier, checks and hashes it, and the next steps read it into host memory and admit the request (steps every
1 ms meanwhile, as an engine's loop would). The plain side: obstore's get of the same two objects into
memory. Each figure is the median of --runs runs, the two sides alternating.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from mstar.engine.resources.lora import LoraAdapterStore, LoraDevicePool, specs_from_config
from mstar.engine.resources.lora.disk_tier import DiskTier
from mstar.engine.resources.lora.manager import LoraManager, Request
from mstar.engine.resources.lora.resolvers import ObjectStoreResolver
from mstar.engine.resources.lora.tools.samples import sample_modules, write_peft_adapter

LLAMA_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000}
BUCKET = "adapters"


def serve_s3() -> tuple[object, str]:
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1",
                      AWS_ENDPOINT_URL=url, AWS_ALLOW_HTTP="true")
    return server, url


def first_use(m: LoraManager, name: str) -> float:
    queue, t = [Request(0, name)], time.perf_counter()
    while queue:
        step = m.step([], queue)
        if step.failed:
            raise SystemExit(f"the adapter failed: {step.failed}")
        queue = [r for r in queue if r.id not in step.admitted]
        time.sleep(0.001)
    return time.perf_counter() - t


def plain(prefix: str) -> float:
    import obstore
    from obstore.store import from_url

    store = from_url(prefix, client_options={"allow_http": "true"})
    t = time.perf_counter()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        obstore.get(store, name).bytes()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import boto3

    server, url = serve_s3()
    root = Path(tempfile.mkdtemp())
    try:
        spec = specs_from_config(LLAMA_7B, max_rank=8, capacity=4 * args.runs)["language_model"]
        folder = write_peft_adapter(root / "ad", sample_modules(spec, 8, seed=0, targets=("qkv_proj", "o_proj")),
                                    alpha=16)
        s3 = boto3.client("s3", endpoint_url=url)
        s3.create_bucket(Bucket=BUCKET)
        for i in range(args.runs):
            for f in ("adapter_config.json", "adapter_model.safetensors"):
                s3.upload_file(str(folder / f), BUCKET, f"tenants/ad{i}/{f}")
        size = (folder / "adapter_model.safetensors").stat().st_size
        m = LoraManager({"language_model": LoraAdapterStore(spec, pin=False)},
                        {"language_model": LoraDevicePool(spec, 4)},
                        resolver=ObjectStoreResolver(f"s3://{BUCKET}/tenants/"),
                        disk_tier=DiskTier(root / "disk", 10**10))
        mine, theirs = [], []
        for i in range(args.runs):
            theirs.append(plain(f"s3://{BUCKET}/tenants/ad{i}/"))
            mine.append(first_use(m, f"ad{i}"))
            m.step([], [])  # its slot let go for the next
        m.close()
        a, b = statistics.median(mine), statistics.median(theirs)
        print(f"adapter {size / 1e6:.1f} MB; median of {args.runs} runs")
        print(f"first use through the manager (resolve, download, check, read, admit): {a * 1e3:7.1f} ms")
        print(f"plain download of the same bytes (obstore get into memory):           {b * 1e3:7.1f} ms")
        print(f"ratio: {a / b:.2f}x")
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
