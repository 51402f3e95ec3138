"""Writes the HLO fixtures of the schedule parser's tests (``tests/measure/fixtures/``):
the train step of a tiny Llama-shaped model (4 scanned layers) on a 2 x 4 H100 cluster,
ZeRO-3 and ZeRO++, compiled by XLA's GPU compiler with the default flags and with the
pipelined collectives (``run.flag_set``). Needs JAX's CUDA plugin, not a GPU:

    python -m benchmarks.gpu_cluster.fixtures

Each program is written gzipped, as ``compiled.as_text()`` prints it less what the schedule
replay does not read (``slim``), to keep the files small.
"""

from __future__ import annotations

import gzip
import os
import pathlib
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_cluster.llama import LlamaShape  # noqa: E402

TINY = LlamaShape("tiny", layers=4, d_model=64, heads=4, kv_heads=2, ffn=128, vocab=256)
OUT = ROOT / "tests" / "measure" / "fixtures"


def _config(text: str) -> str:
    """What the replay reads of a ``backend_config={...}``: a loop's trip count, whether a
    collective runs synchronously."""
    trips = re.search(r'"known_trip_count":\{"n":"\d+"\}', text)
    sync = re.search(r'"is_sync":(true|false)', text)
    if trips:
        return f"backend_config={{{trips.group(0)}}}"
    if sync:
        return f'backend_config={{"collective_backend_config":{{{sync.group(0)}}}}}'
    return ""


def slim(text: str) -> str:
    """``metadata={...}`` reduced to a collective's ``op_name`` (less ``jit(run)/shard_map/``),
    ``backend_config={...}`` to what the replay reads (``_config``), no source-location
    tables."""
    def keep(m: re.Match) -> str:
        op = re.search(r'op_name="[^"]*(all_gather|reduce_scatter|all_to_all|psum)[^"/]*"',
                       m.group(0))
        return f"metadata={{{op.group(0)}}}" if op else ""

    # The source-location tables: a title line, then an entry a line, then a blank line.
    text = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*",
                  "", text, flags=re.M)
    text = re.sub(r"metadata=\{[^{}]*\}", keep, text).replace("jit(run)/shard_map/", "")
    out, i = [], 0
    while (j := text.find("backend_config={", i)) >= 0:
        depth, k = 0, j + len("backend_config=")
        for k in range(k, len(text)):
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            if depth == 0:
                break
        out += [text[i:j], _config(text[j:k + 1])]
        i = k + 1
    return re.sub(r", (?=\n|$)", "", "".join(out) + text[i:], flags=re.M)


def main() -> None:
    from benchmarks.gpu_cluster import run

    OUT.mkdir(parents=True, exist_ok=True)
    for config in ("zero3", "zeropp"):
        for flags in ("default", "pipelined"):
            compiled, _, _ = run.compile_step(TINY, 2, 4, run.configs()[config],
                                              run.flag_set(flags), seq=64)
            path = OUT / f"tiny_2x4_{config}_{flags}.hlo.gz"
            # mtime=0: the same program gives the same bytes.
            path.write_bytes(gzip.compress(slim(compiled.as_text()).encode(), mtime=0))
            print(f"wrote {path} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
