"""Every algorithm function keeps its results (and metrics) on the device of its inputs."""

from __future__ import annotations

import pytest
import torch

from trinity_dagster.algorithms import (
    ADVANTAGE_FNS,
    KL_FNS,
    LOSS_AGG_MODES,
    POLICY_LOSS_FNS,
    aggregate_loss,
    apply_kl_penalty,
    compute_advantages,
    entropy_from_logits,
    kl_divergence,
    policy_loss,
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_stay_on_the_input_device(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1], [1, 0, 0]], dtype=torch.bool)
    logits = torch.randn(4, 3, 7, generator=gen)
    logp = torch.log_softmax(logits, -1)[..., 0]
    old = logp + 0.1 * torch.randn(4, 3, generator=gen)
    ref = logp - 0.2 * torch.randn(4, 3, generator=gen)
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0])
    groups = torch.tensor([0, 0, 1, 1])
    cpu = {"mask": mask, "logp": logp, "old": old, "ref": ref, "rewards": rewards}
    on = {key: value.to(device) for key, value in cpu.items()}
    dev = torch.device(device)

    for name in ADVANTAGE_FNS:
        adv = compute_advantages(name, on["rewards"], groups.to(device), on["mask"])
        assert adv.device.type == dev.type
        expected = compute_advantages(name, rewards, groups, mask)
        torch.testing.assert_close(adv.cpu(), expected)
    for name in KL_FNS:
        assert kl_divergence(name, on["logp"], on["ref"]).device.type == dev.type
        token, metrics = apply_kl_penalty(
            on["rewards"], on["logp"], on["ref"], on["mask"], name, 0.1
        )
        assert {token.device.type, *(m.device.type for m in metrics.values())} == {dev.type}
    for mode in LOSS_AGG_MODES:
        assert aggregate_loss(on["logp"], on["mask"], mode).device.type == dev.type
    adv = compute_advantages("grpo", on["rewards"], groups.to(device), on["mask"])
    for name in POLICY_LOSS_FNS:
        loss, metrics = policy_loss(
            name,
            on["logp"],
            on["old"],
            adv,
            on["mask"],
            clip_range_low=0.2,
            clip_range_high=0.28,
            dual_clip=3.0,
            loss_agg_mode="token-mean",
        )
        assert {loss.device.type, *(m.device.type for m in metrics.values())} == {dev.type}
        torch.stack([loss.detach(), *metrics.values()])  # the engine stacks them
    assert entropy_from_logits(logits.to(device)).device.type == dev.type
