"""Which S3 client the transport layer is built on: fsspec+s3fs against obstore.

Both talk to the same moto server (a subprocess on loopback, see
``tests/servers/moto_s3.py``); arms alternate within each round, and the figures are
medians of per-round ratios (s3fs time / obstore time, > 1 means obstore is faster).

Measured per client, each with a client created fresh in the round (as a DataLoader
worker would):

* ``list``: listing a prefix of 300 objects with sizes and ETags;
* ``get``: whole-object downloads of 6 objects of 8 MiB, one after the other;
* ``range``: 100 reads of 8 KiB at random offsets (the header reads of ``.atp`` shards).

Run: ``python benchmarks/objectstore_clients.py [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.servers.moto_s3 import MotoS3Server, s3_environment  # noqa: E402

BUCKET = "bench"
BIG = 8 << 20


def _s3fs_arm(endpoint: str):
    import s3fs

    def make():
        return s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)

    def list_(fs):
        entries = fs.ls(f"{BUCKET}/small", detail=True)
        return [(e["name"], e["size"], e.get("ETag")) for e in entries]

    def get(fs, key):
        return fs.cat_file(f"{BUCKET}/{key}")

    def range_(fs, key, start, end):
        return fs.cat_file(f"{BUCKET}/{key}", start=start, end=end)

    return make, list_, get, range_


def _obstore_arm(endpoint: str):
    import obstore
    from obstore.store import S3Store

    def make():
        return S3Store(BUCKET, endpoint=endpoint, client_options={"allow_http": True})

    def list_(store):
        return [(m["path"], m["size"], m["e_tag"]) for batch in obstore.list(store, "small")
                for m in batch]

    def get(store, key):
        return obstore.get(store, key).bytes()

    def range_(store, key, start, end):
        return obstore.get_range(store, key, start=start, end=end)

    return make, list_, get, range_


def _measure(arm, rng: random.Random) -> dict[str, float]:
    make, list_, get, range_ = arm
    times = {}
    client = make()
    start = time.perf_counter()
    listed = list_(client)
    times["list"] = time.perf_counter() - start
    assert len(listed) == 300, len(listed)
    start = time.perf_counter()
    for n in range(6):
        assert len(get(client, f"big/{n}.bin")) == BIG
    times["get"] = time.perf_counter() - start
    offsets = [rng.randrange(0, BIG - 8192) for _ in range(100)]
    start = time.perf_counter()
    for offset in offsets:
        assert len(range_(client, f"big/{offset % 6}.bin", offset, offset + 8192)) == 8192
    times["range"] = time.perf_counter() - start
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with MotoS3Server() as server:
        os.environ.update(s3_environment(server.endpoint_url))
        server.create_bucket(BUCKET)
        client = server.client()
        for n in range(300):
            client.put_object(Bucket=BUCKET, Key=f"small/{n:04d}.pt", Body=b"x" * 100)
        payload = os.urandom(BIG)
        for n in range(6):
            client.put_object(Bucket=BUCKET, Key=f"big/{n}.bin", Body=payload)
        arms = {"s3fs": _s3fs_arm(server.endpoint_url),
                "obstore": _obstore_arm(server.endpoint_url)}
        rng = random.Random(0)
        _measure(arms["s3fs"], rng), _measure(arms["obstore"], rng)  # warm-up
        ratios: dict[str, list[float]] = {"list": [], "get": [], "range": []}
        raw: dict[str, dict[str, list[float]]] = {a: {k: [] for k in ratios} for a in arms}
        for round_number in range(args.rounds):
            order = list(arms) if round_number % 2 == 0 else list(arms)[::-1]
            seed = rng.randrange(1 << 30)
            got = {name: _measure(arms[name], random.Random(seed)) for name in order}
            for key in ratios:
                ratios[key].append(got["s3fs"][key] / got["obstore"][key])
                for name in arms:
                    raw[name][key].append(got[name][key])
    print(f"load: {os.getloadavg()}")
    for key, values in ratios.items():
        print(f"{key:6s} s3fs/obstore median {statistics.median(values):.2f}x  "
              f"(s3fs {statistics.median(raw['s3fs'][key]) * 1e3:.0f} ms, "
              f"obstore {statistics.median(raw['obstore'][key]) * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
