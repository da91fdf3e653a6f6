"""What hashing and encryption cost: MB/s of the write path with and without them.

    python -m bench.crypto_throughput [--mb 256] [--dir /tmp] [--checksum blake3|sha256]

Measured side by side in one run, on the same bytes: each checksum algorithm alone and
AES-256-GCM + the chosen one in memory (the CPU cost), and a checkpoint file written
through ``Storage.open_write`` to local disk plainly (hash only) and encrypted.  Ratios
are what to compare; absolute numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from raycheckpoint.integrity import digest
from raycheckpoint.integrity.crypto import ChunkEncryptor, FileCipher
from raycheckpoint.storage import Storage

CHUNK = 8 << 20


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--checksum", choices=digest.ALGORITHMS, default=digest.DEFAULT)
    args = ap.parse_args()
    alg = args.checksum
    data = os.urandom(args.mb << 20)
    view = memoryview(data)
    cipher = FileCipher(os.urandom(32))

    def hash_only(algorithm: str):
        def run():
            h = digest.new(algorithm)
            for i in range(0, len(data), CHUNK):
                h.update(view[i:i + CHUNK])
        return run

    def encrypt_and_hash():
        h = digest.new(alg)
        enc = ChunkEncryptor(cipher, "x")
        for i in range(0, len(data), CHUNK):
            for sealed in enc.update(view[i:i + CHUNK]):
                h.update(sealed)
        h.update(enc.finish())

    root = tempfile.mkdtemp(prefix="rc-crypto-", dir=args.dir)
    st = Storage(root, cipher=cipher, checksum=alg)

    def write(encrypt: bool):
        def run():
            with st.open_write("f", encrypt=encrypt) as w:
                for i in range(0, len(data), CHUNK):
                    w.write(view[i:i + CHUNK])
        return run

    results = {f"{a} (memory)": _best(hash_only(a), args.repeat) for a in digest.ALGORITHMS}
    results.update({
        f"AES-256-GCM + {alg} (memory)": _best(encrypt_and_hash, args.repeat),
        f"write + {alg} + fsync (disk)": _best(write(False), args.repeat),
        f"write + AES-256-GCM + {alg} + fsync (disk)": _best(write(True), args.repeat),
    })
    st.delete_tree("")
    mb = args.mb * 1.048576
    for name, s in results.items():
        print(f"{name:<46} {mb / s:8.0f} MB/s  ({s:.3f} s for {mb:.0f} MB)")
    mem = results[f"AES-256-GCM + {alg} (memory)"] / results[f"{alg} (memory)"]
    disk = (results[f"write + AES-256-GCM + {alg} + fsync (disk)"]
            / results[f"write + {alg} + fsync (disk)"])
    print(f"encryption cost: {mem:.2f}x the time of hashing alone in memory, {disk:.2f}x the "
          "time of a hashed write to disk")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
