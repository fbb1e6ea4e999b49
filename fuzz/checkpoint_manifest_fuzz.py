"""Fuzz target for the checkpoint manifest parser (``asteria.train.checkpoint.parse_manifest``).

Every input must either parse into a ``Manifest`` or raise ``CheckpointError``; any other exception
(or a crash) is a bug. Inputs are raw bytes and, to reach the semantic checks, a valid manifest with
one field replaced by fuzzed JSON.

    python3 fuzz/checkpoint_manifest_fuzz.py --seconds 20     # atheris (libFuzzer) when installed,
                                                              # else a hypothesis-driven bytes fuzzer
Extra arguments go to libFuzzer (e.g. a corpus directory, ``-max_len=4096``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy  # noqa: F401  (imported before instrumentation: only the parser is instrumented)
import torch  # noqa: F401

try:
    import atheris
except ImportError:  # atheris has no wheel for every Python: fall back to hypothesis
    atheris = None

if atheris is not None:
    with atheris.instrument_imports(include=["asteria.train.checkpoint"]):
        from asteria.train import checkpoint
else:
    from asteria.train import checkpoint

VALID = checkpoint.Manifest(checkpoint.FORMAT, 12, 2, {
    ".metadata": checkpoint.FileEntry(812, "ab" * 32),
    "__0_0.distcp": checkpoint.FileEntry(1 << 20, "0123456789abcdef" * 4),
}, {"model": "tiny", "optimizer": "soap", "steps": 100})
FIELDS = ("format", "step", "world_size", "files", "config")


def spliced(selector: int, fragment: bytes) -> bytes:
    """The valid manifest with one field (or one file entry) replaced by ``fragment`` as raw JSON."""
    doc = json.loads(VALID.to_json())
    marker = "\u0000SPLICE\u0000"
    if selector % 7 < len(FIELDS):
        doc[FIELDS[selector % 7]] = marker
    elif selector % 7 == 5:
        doc["files"][".metadata"] = marker
    else:
        doc["files"]["__0_0.distcp"]["size"] = marker
    return json.dumps(doc).encode().replace(json.dumps(marker).encode(), fragment)


def check(data: bytes) -> None:
    """The property: a Manifest or a CheckpointError, nothing else."""
    for candidate in (data, spliced(data[0] if data else 0, data[1:])):
        try:
            manifest = checkpoint.parse_manifest(candidate)
        except checkpoint.CheckpointError:
            continue
        # What parses must round-trip.
        assert checkpoint.parse_manifest(manifest.to_json().encode()) == manifest, candidate


def seeds() -> list[bytes]:
    text = VALID.to_json().encode()
    return [text, b"\x00" + text, b"\x01-1", b"\x02[1,2]", b"\x03{}", b"\x05{\"size\": 1}", b"\x06true", b"{" * 64]


def run_atheris(seconds: int, extra: list[str]) -> None:
    corpus = Path(tempfile.mkdtemp(prefix="manifest-corpus-"))
    for i, seed in enumerate(seeds()):
        (corpus / f"seed{i}").write_bytes(seed)
    atheris.Setup([sys.argv[0], f"-max_total_time={seconds}", "-max_len=8192", *extra, str(corpus)], check)
    atheris.Fuzz()


def run_hypothesis(seconds: int) -> int:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=80),
        lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=20), inner, max_size=5),
        max_leaves=20)
    inputs = st.one_of(
        st.binary(max_size=4096),
        st.sampled_from(seeds()),
        st.tuples(st.integers(0, 255), json_values).map(lambda t: bytes([t[0]]) + json.dumps(t[1]).encode()),
        st.tuples(st.integers(0, 255), st.binary(max_size=64)).map(lambda t: bytes([t[0]]) + t[1]),
    )
    examples = 0

    @settings(max_examples=500, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(inputs)
    def batch(data: bytes) -> None:
        nonlocal examples
        examples += 1
        check(data)

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        batch()
    return examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=20, help="how long to fuzz [default: 20]")
    parser.add_argument("--engine", choices=("auto", "atheris", "hypothesis"), default="auto")
    args, extra = parser.parse_known_args()
    if args.seconds < 1:
        parser.error(f"invalid --seconds={args.seconds}: must be >= 1")
    engine = args.engine if args.engine != "auto" else ("atheris" if atheris is not None else "hypothesis")
    if engine == "atheris":
        if atheris is None:
            parser.error("invalid --engine=atheris: atheris is not installed")
        run_atheris(args.seconds, extra)
    else:
        examples = run_hypothesis(args.seconds)
        print(f"manifest fuzz (hypothesis): {examples} inputs in {args.seconds} s, no failure")


if __name__ == "__main__":
    main()
