"""Training of small OLMo-style language models with AdamW or an Asteria optimizer, and reports."""
