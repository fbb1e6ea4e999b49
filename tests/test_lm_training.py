"""All three optimizers train a small byte-level transformer LM at least as well as AdamW in the same
number of steps (sensible learning rates, async mode, the default embedded corpus), measured as the targets
are, by the validation loss: the last steps' training loss (8 x 64 tokens a batch) scatters by more than the
margins. Shampoo and KL-Shampoo end 6-8% below AdamW. SOAP, which starts preconditioning at step f, matches
it: 0.9915x AdamW's on an AMD EPYC and 1.0071x on an Intel Xeon (the same code; BLAS kernels that differ by
CPU move a 120-step run by that much), so its bound is the loss target's "within 1%" with that scatter added.

The async runs take the deterministic rule with each version used 2 steps after its snapshot (the install
delay the targets allow), so that the outcome does not hang on how fast the worker runs beside the test: under
the newest-finished rule SOAP's loss lands anywhere between its figures at lag 0 and at a whole interval's lag,
0.990x and 1.000x AdamW's (measured), too close to the bound.

The recipe is a constant learning rate without clipping, as the comparison was set up. Under the CLI's
default warm-up + cosine schedule the short run favours AdamW more: measured on the 2-core development
machine, AdamW reaches 2.281 at lr 1e-2 and SOAP 2.288 at its best lr (1e-2), while Shampoo (2.064) and
KL-Shampoo (2.272, both at 3e-3) stay ahead (see docs/results.md)."""

from __future__ import annotations

import pytest

import asteria
from asteria.train.loop import RunConfig, train

COMMON = dict(steps=120, batch_size=8, seq_len=64, staleness=1, precondition_frequency=10, workers=1,
              eval_every=60, max_bytes=400_000, lr_schedule="constant", warmup_steps=0, grad_clip=0.0)


@pytest.fixture(scope="module")
def adamw_loss(tmp_path_factory) -> float:
    cfg = RunConfig(optimizer="adamw", lr=3e-3, **COMMON)
    return train(cfg, tmp_path_factory.mktemp("adamw"), progress=False)["final_val_loss"]


@pytest.mark.filterwarnings(f"ignore::{asteria.RefreshBacklogWarning.__module__}.RefreshBacklogWarning")
@pytest.mark.parametrize("optimizer, lr", [("shampoo", 3e-3), ("soap", 3e-3), ("kl-shampoo", 3e-3)])
def test_second_order_optimizers_match_or_beat_adamw(optimizer, lr, adamw_loss, tmp_path):
    # A job that takes longer than 2 steps is waited for (a backlog warning): the result stays the same.
    summary = train(RunConfig(optimizer=optimizer, lr=lr, mode="async", deterministic=True, lag_steps=2, **COMMON),
                    tmp_path, progress=False)
    bound = adamw_loss * (1.02 if optimizer == "soap" else 1.0)
    assert summary["final_val_loss"] <= bound, (optimizer, summary["final_val_loss"], adamw_loss)
    assert summary["runtime_stats"]["refreshes"] > 0
    assert summary["runtime_stats"]["refresh_failures"] == 0
