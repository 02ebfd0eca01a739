"""The names a config may give each part of an algorithm. `trinity_dagster.algorithms`
registers one function per name, its registries typed by these and checked against them when
it is imported; this module is torch-free so that the config validates against it."""

from __future__ import annotations

from typing import Literal

AdvantageFn = Literal["grpo", "rloo", "reinforce_plus_plus", "opmd"]
# Advantages estimated with a learned value model (GAE); Trinity-RFT names GAE `ppo`.
CriticAdvantageFn = Literal["ppo"]
PolicyLossFn = Literal["ppo", "gspo", "sft"]
KlFn = Literal["none", "k1", "k2", "k3", "low_var_kl", "abs"]
LossAggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
