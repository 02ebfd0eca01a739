"""The built-in explorer: task sets, tokenizer, rewards, the initial model, rollouts, evaluation.

`tasks`, `rewards` and `eval_versions` import neither torch nor transformers; the other
modules do, so import them only where a model runs (see docs/explorer.md).
"""
