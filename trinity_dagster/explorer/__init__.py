"""The built-in explorer: task sets, tokenizer, rewards, the initial model, rollouts, evaluation.

`tasks` and `rewards` import neither torch nor transformers; the other modules do, so import
them only where a model runs (see docs/explorer.md).
"""
