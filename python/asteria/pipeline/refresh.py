"""Refreshers: who computes the preconditioners from the factors, and when they come into use.

``SyncRefresher`` is the native baseline: every refresh runs inside ``step()`` on the parameter's
device with torch. ``AsyncRefresher`` snapshots the factors into (pinned) host rings, has the C++
engine compute roots or eigenbases on its worker threads, and installs the versions that the coherence
registry activates at each step boundary.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

from asteria import functional as F
from asteria.checks import check_arg, check_counts
from asteria.config import RuntimeConfig
from asteria.errors import RefreshError
from asteria.pipeline.factors import FactorSet, RootRequest
from asteria.pipeline.refresh_math import refresh_set
from asteria.pipeline.timeline import ActivationRule

SAVED = "state_dict['refresher']"  # how a checkpoint's refresher state is named in errors


class Refresher(ABC):
    """Computes and installs preconditioners for a fixed list of factor sets."""

    #: the keys of ``state()``, checked before a checkpoint is loaded (``validate_state_dict``)
    STATE_KEYS: tuple[str, ...] = ()

    def __init__(self, sets: list[FactorSet], config: RuntimeConfig, interval: int) -> None:
        self.sets = sets
        self.config = config
        self.interval = interval
        #: from which step each version is in use (``asteria.pipeline.timeline``; checks ``lag_steps``)
        self.rule = ActivationRule.of(config, interval)
        self._newest_versions = [0] * len(sets)
        self.tier: Any = None  # the optimizer's PreconditionerTier: told before a preconditioner is overwritten
        self._installs: list[tuple[int, int]] = []  # (set index, version) per block whose version changed

    def _set_version(self, index: int, block: int, version: int) -> None:
        """Records that ``block`` of set ``index`` now uses ``version`` (see ``take_installs``)."""
        versions = self.sets[index].versions
        if versions[block] != version:
            versions[block] = version
            self._installs.append((index, version))

    def newest_version(self, index: int) -> int:
        """The newest version of set ``index`` snapshotted so far (0: none)."""
        return self._newest_versions[index]

    def take_installs(self) -> list[tuple[int, int]]:
        """``(set index, version)`` of every block install since the last call."""
        installs, self._installs = self._installs, []
        return installs

    @abstractmethod
    def refresh(self, step: int, items: list[tuple[int, int, RootRequest]]) -> None:
        """Starts, for each ``(set index, version, request)``, that refresh of the set from its factors
        as they are at ``step``."""

    @abstractmethod
    def activate(self, step: int) -> None:
        """Installs into ``preconditioners`` the versions the schedule gives for ``step``."""

    def before_factor_update(self) -> None:
        """Called before the factors are modified in place (a snapshot may still be reading them)."""

    def poll(self, step: int) -> None:
        """Moves finished transfers along without waiting (``step``: the last completed step)."""

    def ready(self) -> None:
        """Makes the current stream wait for the installs issued so far (before it reads them)."""

    def check_backlog(self, step: int) -> None:
        """Warns (once) when the workers fall behind the schedule; called at refresh steps."""

    @abstractmethod
    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint at ``step`` must hold for a resumed run to continue bit for bit."""

    @abstractmethod
    def load_state(self, state: dict[str, Any]) -> None:
        """Restores ``state()`` into a refresher over the same factor sets."""

    def check_state(self, state: dict[str, Any]) -> None:
        """Raises ``ValueError`` naming the first entry of ``state`` (a checkpoint's ``state()``, holding
        ``STATE_KEYS``) that ``load_state`` could not restore into this refresher; changes nothing."""
        if "newest_versions" in state:
            check_counts(state["newest_versions"], f"{SAVED}['newest_versions']", len(self.sets),
                         "the newest version snapshotted of each factor set")
        if "consecutive_failures" in state:
            failures = state["consecutive_failures"]
            check_arg(isinstance(failures, (list, tuple)) and len(failures) == len(self.sets),
                      f"{SAVED}['consecutive_failures']", failures, f"must be a list of {len(self.sets)} entries, "
                      "one per factor set")
            for index, (counts, fset) in enumerate(zip(failures, self.sets)):
                check_counts(counts, f"{SAVED}['consecutive_failures'][{index}]", fset.batch,
                             f"the failed refreshes in a row of each block of {fset.name}")

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters for ``runtime_stats()``."""

    def close(self) -> None:
        """Releases threads and buffers. Idempotent."""

    def host_bytes(self) -> int:
        """Bytes of host memory held for refreshes."""
        return 0

    def lane_bytes(self) -> int:
        """Bytes of the parameters' device held by the device lane's process for its slots (0: none)."""
        return 0

    def lane_cache_bytes(self) -> int:
        """The most the device lane's process has held on the device beyond its slots, measured so far (0: none)."""
        return 0

    def identity(self) -> dict[str, Any] | None:
        """The rank layout a checkpoint of this refresher belongs to (None: a single process)."""
        return None

    def _raise_failure(self, fset: FactorSet, block: int, version: int, cause: str) -> None:
        raise RefreshError(fset.block_params[block], fset.describe(block), version, cause)


class SyncRefresher(Refresher):
    """Every refresh computed at its own step on the parameter's device (torch eigh), in float32 matrix
    products whatever ``torch.set_float32_matmul_precision`` says: TF32's 10-bit mantissa would blur
    the power step of an eigenbasis refresh, and the CPU workers compute it in float32 (see
    ``float32_matmuls``)."""

    STATE_KEYS = ("newest_versions", "consecutive_failures")

    def __init__(self, sets: list[FactorSet], config: RuntimeConfig, interval: int) -> None:
        super().__init__(sets, config, interval)
        self._refreshes = 0
        self._failures = 0
        self._skipped = 0
        self._consecutive = [np.zeros(s.batch, dtype=np.int64) for s in sets]
        self._last_error = "non-finite factor, or a refresh result that is not finite"
        self._errors: dict[str, str] = {}  # a failed block's description -> why
        self._seconds = 0.0

    def refresh(self, step: int, items: list[tuple[int, int, RootRequest]]) -> None:
        self._refresh(step, items)

    def _refresh(self, step: int, items: list[tuple[int, int, RootRequest]]) -> None:
        started = time.perf_counter()
        results = []
        for index, version, request in items:
            fset = self.sets[index]
            refreshed = refresh_set(fset, fset.factors, request, fset.preconditioners, fset.installed)
            results.append((index, version, refreshed, refreshed.usable.cpu().numpy()))
            self._skipped += int(refreshed.skipped)
        # Check every bound before changing anything, so that a raise leaves all state as it was.
        for index, version, _, ok in results:
            consecutive = self._consecutive[index]
            failing = np.where(~ok & (consecutive + 1 >= self.config.max_consecutive_failures))[0]
            if failing.size:
                self._raise_failure(self.sets[index], int(failing[0]), version, self._last_error)
        for index, version, refreshed, ok in results:
            fset, consecutive = self.sets[index], self._consecutive[index]
            usable = refreshed.usable
            if refreshed.order is not None and fset.permute is not None:
                warm = (usable & fset.installed).nonzero().flatten()
                if warm.numel():
                    fset.permute(warm, refreshed.order[warm])
            fset.preconditioners.copy_(torch.where(F.batch_view(usable, refreshed.new), refreshed.new,
                                                   fset.preconditioners))
            fset.installed |= usable
            consecutive[:] = np.where(ok, 0, consecutive + 1)
            for block in np.where(ok)[0]:
                self._set_version(index, int(block), version)
            self._failures += int((~ok).sum())
            self._errors.update((fset.describe(int(block)), self._last_error) for block in np.where(~ok)[0])
            self._refreshes += fset.batch
            self._newest_versions[index] = version
        self._seconds += time.perf_counter() - started

    def activate(self, step: int) -> None:
        """Nothing to do: a sync refresh is in use from its own step."""

    def state(self, step: int) -> dict[str, Any]:
        return {"newest_versions": list(self._newest_versions),
                "consecutive_failures": [c.tolist() for c in self._consecutive]}  # ints: weights_only loads

    def load_state(self, state: dict[str, Any]) -> None:
        self._newest_versions = list(state["newest_versions"])
        self._consecutive = [np.array(c, dtype=np.int64) for c in state["consecutive_failures"]]

    def stats(self) -> dict[str, Any]:
        return {
            "refreshes": self._refreshes,
            "refresh_failures": self._failures,
            "refresh_errors": dict(self._errors),
            "refreshes_skipped": self._skipped,
            "refresh_seconds_on_step": self._seconds,
            "staleness_histogram": [],
            "waits": 0,
            "wait_seconds": 0.0,
        }
