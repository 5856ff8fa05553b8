"""``python -m orda_tp.topk_cache verify DIR [DIR ...]``: read every shard of each cache directory (a
top-k or a hidden-state cache) and check its bytes against their checksums; prints a line per
directory and exits 1 if any shard is damaged, missing or inconsistent."""

from __future__ import annotations

import argparse
import os
import sys

from .hidden import HiddenCacheReader, HiddenCacheSettings
from .reader import ShardReader, TopKCacheReader
from .shards import CacheSettings, ShardSettings


def _reader(directory: str) -> ShardReader[ShardSettings]:
    """The reader of the cache kind whose shards ``directory`` holds (a top-k cache if none)."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    if any(name.startswith(HiddenCacheSettings.PREFIX + "-") for name in names) and not any(
        name.startswith(CacheSettings.PREFIX + "-") for name in names
    ):
        return HiddenCacheReader(directory)  # type: ignore[return-value]
    return TopKCacheReader(directory)  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orda_tp.topk_cache", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="check every shard's bytes against their checksums")
    verify.add_argument("directories", nargs="+", metavar="DIR")
    args = parser.parse_args(argv)
    failed = 0
    for directory in args.directories:
        try:
            reader = _reader(directory)
            done = reader.verify()
        except (ValueError, OSError) as error:
            print(f"FAIL {directory}: {error}")
            failed += 1
            continue
        rate = done.bytes / done.seconds / 1e9 if done.seconds > 0 else float("inf")
        unchecked = f", {done.unchecked} without checksums (not verifiable)" if done.unchecked else ""
        print(
            f"OK   {directory}: {len(reader.shards)} shards, {reader.num_tokens} rows; {done.verified} verified "
            f"({done.bytes / 1e6:.1f} MB in {done.seconds:.2f} s, {rate:.2f} GB/s){unchecked}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
