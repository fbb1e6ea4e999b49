"""Peer implementations in the bench, on the same model, batches and schedule as Asteria's runs: Meta's
Distributed Shampoo (``ds-*``, imported from a local checkout of facebookresearch/optimizers that the user
names with ``--peer-path``; never vendored) and heavyball's SOAP and KL-Shampoo (``hb-*``, where heavyball is
installed). Each is set up with the hyperparameters of the Asteria optimizer it stands beside (the
defaults of ``asteria.Shampoo``, ``asteria.SOAP`` and ``asteria.KLShampoo``, with the run's beta2 where it
sets one), the run's learning rate, weight decay, refresh interval and block size; both refresh every block
at its interval, inside ``step()``. On the CPU heavyball runs eagerly: its default compile mode (max-autotune)
fails in torch 2.13's CPU inductor, and compiling takes longer than a short CPU bench; on a GPU it keeps it.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

import torch

from asteria.optim.kl_shampoo import KLShampoo
from asteria.optim.shampoo import Shampoo
from asteria.optim.soap import SOAP

#: the peers and the Asteria optimizer each stands beside
PEERS = {"ds-shampoo": "shampoo", "ds-soap": "soap", "ds-kl-shampoo": "kl-shampoo",
         "hb-soap": "soap", "hb-kl-shampoo": "kl-shampoo"}
ASTERIA_CLASSES = {"shampoo": Shampoo, "soap": SOAP, "kl-shampoo": KLShampoo}


def betas_with(kind: type, beta2: float | None) -> tuple[float, float]:
    """The betas ``kind`` (an optimizer class) takes by default, its constructor's, with ``beta2`` in place of
    the second where given."""
    beta1, default = inspect.signature(kind.__init__).parameters["betas"].default
    return (beta1, default if beta2 is None else beta2)


def import_distributed_shampoo(peer_path: str | None) -> Any:
    """The ``distributed_shampoo`` package, from the folder ``peer_path`` that holds it (a checkout of
    facebookresearch/optimizers), or from the environment when None."""
    if peer_path is not None:
        folder = Path(peer_path).expanduser().resolve()
        if not (folder / "distributed_shampoo" / "__init__.py").is_file():
            raise ValueError(f"Invalid peer_path={peer_path!r}: it must be a folder holding distributed_shampoo/ (a "
                             "checkout of github.com/facebookresearch/optimizers)")
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    try:
        return importlib.import_module("distributed_shampoo")
    except ImportError as error:
        raise ValueError(f"Invalid peer_path={peer_path!r}: Meta's Distributed Shampoo does not import ({error}); "
                         "give --peer-path, the folder of a checkout of github.com/facebookresearch/optimizers"
                         ) from None


def make_peer(name: str, params: Any, lr: float, weight_decay: float, frequency: int, max_dim: int,
              peer_path: str | None, beta2: float | None = None) -> torch.optim.Optimizer:
    """The peer optimizer ``name`` over ``params`` (see the module docstring)."""
    betas = betas_with(ASTERIA_CLASSES[PEERS[name]], beta2)
    if name.startswith("ds-"):
        ds = import_distributed_shampoo(peer_path)
        common = dict(lr=lr, weight_decay=weight_decay, max_preconditioner_dim=max_dim,
                      precondition_frequency=frequency, start_preconditioning_step=frequency,
                      use_bias_correction=True, weight_decay_type=ds.WeightDecayType.DECOUPLED)
        if name == "ds-shampoo":  # asteria.Shampoo's defaults: eps 1e-12, Adam grafting with betas[1]
            return ds.DistributedShampoo(params, betas=betas, epsilon=1e-12,
                                         grafting_config=ds.AdamPreconditionerConfig(beta2=betas[1], epsilon=1e-8),
                                         preconditioner_config=ds.DefaultShampooConfig, **common)
        if name == "ds-soap":  # asteria.SOAP's: eps 1e-8
            return ds.DistributedShampoo(params, betas=betas, epsilon=1e-8,
                                         preconditioner_config=ds.DefaultSOAPConfig, **common)
        return ds.DistributedShampoo(params, betas=betas, epsilon=1e-8,  # asteria.KLShampoo's
                                     preconditioner_config=ds.EigendecomposedKLShampooPreconditionerConfig(), **common)
    try:
        heavyball = importlib.import_module("heavyball")
    except ImportError as error:
        raise ValueError(f"Invalid optimizer={name!r}: heavyball is not installed ({error}); pip install heavyball") \
            from None
    params = list(params)
    heavyball_compile(heavyball, on_cpu=all(p.device.type == "cpu" for p in params))
    if name == "hb-soap":
        return heavyball.SOAP(params, lr=lr, betas=betas, shampoo_beta=betas[1], eps=1e-8,
                              weight_decay=weight_decay, precondition_frequency=frequency, max_precond_dim=max_dim)
    return heavyball.KLShampoo(params, lr=lr, betas=betas, shampoo_beta=betas[1], eps=1e-8,
                               weight_decay=weight_decay, precondition_frequency=frequency, max_precond_dim=max_dim)


_HEAVYBALL_COMPILE: list[Any] = []  # heavyball's own compile mode, read once before it is changed


def heavyball_compile(heavyball: Any, on_cpu: bool) -> None:
    """Sets heavyball's (module-wide) compile mode for the run: none on the CPU (see the module docstring), its
    own elsewhere. A heavyball without the setting is left as it is."""
    utils = getattr(heavyball, "utils", None)
    if utils is None or not hasattr(utils, "compile_mode"):
        return
    if not _HEAVYBALL_COMPILE:
        _HEAVYBALL_COMPILE.append(utils.compile_mode)
    utils.compile_mode = None if on_cpu else _HEAVYBALL_COMPILE[0]
