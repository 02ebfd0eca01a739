"""Checkpoints, their manifests and retention; published weights; the sync/save rules."""
