"""Collective weight sync (`synchronizer.sync_method: nccl`): engine rank 0 sends weights to
explorers over a `torch.distributed` group of their own, gloo on CPU and NCCL on CUDA.

- `buckets`: the wire layout of one weights version (tensors packed into buckets, each with
  a checksum the receiver verifies);
- `group`: the rendezvous store and the two-rank process groups a transfer runs in;
- `sender`: the versions engine rank 0 holds for explorers and the transfers it serves;
- `receiver`: an explorer's side, which copies a version into its loaded model in place;
- `errors`: `WeightSyncError`, which a failed transfer raises (no torch import);
- `announce`: the file that tells explorers which version the running service holds.
"""
