"""The run folder (``--out``): claimed for a new run, for ``--resume`` of an earlier one, or for ``--overwrite``,
which holds the earlier run's files aside until the new run is set up."""

from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path

from asteria.train import checkpoint

RUN_FILES = ("metrics.jsonl", "summary.json", "tensorboard", "checkpoints")  # what a run writes in --out
TRACE_PREFIX = "trace-rank"  # and, with --profile-steps, its traces

#: where ``--overwrite`` moves an earlier run's files until the new run is set up (data, model and optimizer made,
#: its checkpoint checked): a run refused before then gives them back instead of leaving neither run
REPLACED = ".replaced-run"


def earlier_run(out: Path) -> list[str]:
    """The files of an earlier run in ``out`` (none where it is no folder)."""
    if not out.is_dir():
        return []
    return sorted({p.name for p in out.iterdir() if p.name in RUN_FILES or p.name.startswith(TRACE_PREFIX)})


def replacing(out: Path) -> None:
    """Says on stderr that ``out``'s earlier run is being replaced (``bench`` and ``demo`` regenerate theirs)."""
    earlier = earlier_run(out)
    if earlier:
        print(f"asteria: replacing the earlier run in {out} ({', '.join(earlier)})", file=sys.stderr)


def claim_out(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuses a folder that holds an earlier run (``ValueError``), unless ``resume`` continues it from a
    checkpoint or ``overwrite`` replaces it (with ``resume``: only when there is no checkpoint)."""
    if not overwrite:  # an --overwrite cut off before its run was set up (killed) left the earlier run aside
        settle_replaced(out, restore=True)
    earlier = earlier_run(out)
    published = checkpoint.published(out / "checkpoints")
    if resume and published:
        return
    if overwrite:
        if (out / REPLACED).exists():  # (from a replacement that was cut off: --overwrite replaces it too)
            shutil.rmtree(out / REPLACED)
        if earlier:
            (out / REPLACED).mkdir()
            for name in earlier:
                (out / name).rename(out / REPLACED / name)
    elif published:
        raise ValueError(f"Invalid out={str(out)!r}: it holds checkpoints of an earlier run; pass --resume to "
                         f"continue it, --overwrite to replace it, or choose another --out")
    elif {"metrics.jsonl", "summary.json"} & set(earlier):
        nothing = " and no checkpoint to resume from" if resume else ""
        raise ValueError(f"Invalid out={str(out)!r}: it holds an earlier run ({', '.join(earlier)}){nothing}; "
                         "choose another --out, or pass --overwrite to replace it")


def settle_replaced(out: Path, restore: bool) -> None:
    """Ends ``--overwrite``'s hold on the earlier run: gives its files back (``restore``: the new run, not set up,
    has written nothing of its own but its empty metrics), or removes them once the new run is set up."""
    replaced = out / REPLACED
    if not replaced.exists():
        return
    # (Several ranks sharing the folder may settle it at once: what another one moved or removed is skipped.)
    if restore:
        for path in list(replaced.iterdir()):
            with contextlib.suppress(FileNotFoundError):
                if not path.is_dir():  # (over what the new run wrote while being set up: its empty metrics.jsonl)
                    path.replace(out / path.name)
                elif not (out / path.name).exists():
                    path.rename(out / path.name)
    shutil.rmtree(replaced, ignore_errors=True)
