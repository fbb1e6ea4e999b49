"""Training of small OLMo-style language models with AdamW or an Asteria optimizer, and reports."""

import importlib.util

_MISSING = [name for name in ("tqdm", "matplotlib", "tensorboard") if importlib.util.find_spec(name) is None]
if _MISSING:
    raise ImportError(f"the asteria command needs the train extra, and {', '.join(_MISSING)} is not installed: "
                      "pip install 'asteria[train]' (or bash scripts/setup.sh)")
