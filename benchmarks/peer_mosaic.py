"""The MosaicML ``streaming`` arm of ``benchmarks/peers.py``, run in the peer's own venv.

``mosaicml-streaming`` 0.13 pins ``numpy<2.2`` and ``transformers<5`` (which needs
``huggingface_hub<1.0``) and imports ``torchvision`` from ``streaming.vision``; none of
that can live next to the project's numpy 2.4, huggingface_hub 2.x and CPU torch, so
``peers.py`` builds a separate virtual environment (``benchmarks/_work/mosaic-venv``)
and runs this file there as a child process. It talks JSON over stdin/stdout (answers
prefixed with ``@@``), one command per line, so the parent can interleave its runs with
the other arms:

* ``{"op": "convert", "source": npz, "out": dir, "size_limit": bytes}``: write MDS
  shards from the structures in ``source`` with ``MDSWriter``;
* ``{"op": "read", "remote": "s3://...", "compute": s, "batch_size": n, "ragged": b,
  "endpoint": url}``: one pass of ``StreamingDataset(remote=..., local=<fresh dir>)`` through a
  ``DataLoader`` (``ragged``: structures of different sizes, atoms concatenated), the
  consumer sleeping ``compute`` seconds per batch; the answer lists the pass's energies
  (float32, sorted), which the parent checks against the structures written;
* ``{"op": "quit"}``.

The S3 endpoint comes from ``S3_ENDPOINT_URL``, as streaming's documentation says (a
``read`` command's ``endpoint`` sets it, so that one child serves every regime).
Only numpy, torch and streaming are imported: no project code.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import types

from harness import PeakSampler  # this file's folder is sys.path[0]


def _import_streaming():
    # streaming/__init__.py imports its image and video dataset subpackages, which need
    # torchvision; the index only has CUDA builds of it, which fail to load next to the
    # CPU torch. They are not used here, so empty modules stand in for them.
    for name in ("streaming.vision", "streaming.multimodal"):
        sys.modules.setdefault(name, types.ModuleType(name))
    import streaming

    return streaming


def convert(source: str, out: str, size_limit: int) -> dict:
    import numpy as np

    streaming = _import_streaming()
    arrays = np.load(source)  # atoms of all structures concatenated, cut at ``offsets``
    offsets = arrays["offsets"]
    z, pos, forces, energy = (arrays[k] for k in ("z", "pos", "forces", "energy"))
    columns = {"z": "ndarray:int64", "pos": "ndarray:float32", "forces": "ndarray:float32",
               "energy": "float32"}
    started = time.perf_counter()
    with streaming.MDSWriter(out=out, columns=columns, size_limit=size_limit) as writer:
        for i in range(len(offsets) - 1):
            atoms = slice(offsets[i], offsets[i + 1])
            writer.write({"z": z[atoms], "pos": pos[atoms], "forces": forces[atoms],
                          "energy": np.float32(energy[i])})
    elapsed = time.perf_counter() - started
    files = [os.path.join(out, n) for n in os.listdir(out)]
    return {"seconds": elapsed, "bytes": sum(os.path.getsize(f) for f in files),
            "files": len(files)}


def _concat(samples: list[dict]) -> dict:
    # structures of different sizes: atoms concatenated (default collate cannot stack them)
    import numpy as np
    import torch

    out = {k: torch.from_numpy(np.concatenate([s[k] for s in samples]))
           for k in ("z", "pos", "forces")}
    out["energy"] = torch.tensor([float(s["energy"]) for s in samples])
    out["n_atoms"] = torch.tensor([len(s["z"]) for s in samples])
    return out


def read(remote: str, compute: float, batch_size: int, ragged: bool = False,
         endpoint: str | None = None) -> dict:
    import torch

    if endpoint:  # streaming reads it whenever it makes an S3 client (once per dataset)
        os.environ["S3_ENDPOINT_URL"] = endpoint

    streaming = _import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    local = tempfile.mkdtemp(prefix="mosaic-local-")
    try:
        with PeakSampler(local) as sampler:
            started = time.perf_counter()
            dataset = streaming.StreamingDataset(remote=remote, local=local, shuffle=True,
                                                 batch_size=batch_size)
            loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size,
                                                 num_workers=0,
                                                 collate_fn=_concat if ragged else None)
            first, last, samples, energies = None, None, 0, []
            for batch in loader:
                last = time.perf_counter() - started
                if first is None:
                    first = last
                samples += len(batch["energy"])
                energies.append(batch["energy"].numpy().astype("float32"))
                time.sleep(compute)  # stands in for a training step
            elapsed = time.perf_counter() - started
        del loader, dataset
        import numpy as np

        energy = np.sort(np.concatenate(energies)) if energies else np.zeros(0, "float32")
        return {"seconds": elapsed, "first_batch_s": first, "last_batch_s": last,
                "samples": samples, "energies": energy.tolist(),
                "rss_growth": sampler.peak_rss - sampler.baseline,
                "disk_peak": sampler.peak_disk}
    finally:
        shutil.rmtree(local, ignore_errors=True)


def main() -> None:
    streaming = _import_streaming()
    print("@@" + json.dumps({"ready": True, "version": streaming.__version__}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "quit":
            break
        try:
            result = convert(**command) if op == "convert" else read(**command)
        except Exception as exc:  # reported to the parent, which records why
            result = {"error": f"{type(exc).__name__}: {exc}"}
        print("@@" + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
