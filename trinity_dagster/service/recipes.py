"""Launch recipes of an N-node engine service for a scheduler: text the user submits.

Both start `torchrun` with the c10d rendezvous of the configuration (`service.nnodes`,
`service.nproc_per_node`, `service.rdzv_endpoint`) on every node, running the service's
rank module; rank 0, wherever the rendezvous puts it, serves the control API and writes the
state file under the run root, which every node must see at the same path.

- Slurm: an `sbatch` script, one `srun` task per node running torchrun.
- Kubernetes: a ConfigMap with the resolved configuration, a headless Service and an
  indexed Job of `nnodes` pods. The endpoint must name the Job's first pod through the
  Service, `JOB-0.SERVICE:PORT`: the recipe takes both names from it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trinity_dagster.config import ConfigError, TrinityConfig
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import torchrun_options
from trinity_dagster.service.processes import RANK_MODULE

SCHEDULERS = ("slurm", "k8s")
CONFIG_MOUNT = "/etc/trinity-dagster"
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_K8S_ENDPOINT = re.compile(rf"(?P<job>{_DNS_LABEL})-0\.(?P<service>{_DNS_LABEL})(\..+)?")


@dataclass(frozen=True)
class RecipeOptions:
    """What the configuration does not say about the cluster."""

    gpus_per_node: int  # 0: request none
    image: str = "trinity-dagster:latest"  # Kubernetes: an image with trinity-dagster installed
    runs_claim: str = "trinity-dagster-runs"  # Kubernetes: the PVC mounted at the run root


def _multi_node(config: TrinityConfig) -> None:
    """Refuse a one-node configuration: a scheduler recipe is for N nodes."""
    if config.service.nnodes == 1:
        raise ConfigError(
            "service.nnodes is 1: a launch recipe is for N nodes; set service.nnodes, "
            "service.rdzv_endpoint (and service.allow_non_loopback for a cluster address)"
        )


def _torchrun(config: TrinityConfig, config_file: str) -> list[str]:
    """The torchrun command every node runs."""
    return ["torchrun", *torchrun_options(config), "-m", RANK_MODULE, "-c", config_file]


def _summary(config: TrinityConfig) -> str:
    """Comment lines: the run, nodes x ranks = world size = tp x pp x dp, the endpoints."""
    service, megatron = config.service, config.megatron
    per_node = service.procs_per_node(megatron.world_size)
    return (
        f"# trinity-dagster engine service of run {config.name!r}:\n"
        f"# {service.nnodes} nodes x {per_node} ranks = world size {megatron.world_size} "
        f"(tp {megatron.tensor_model_parallel_size} x pp "
        f"{megatron.pipeline_model_parallel_size} x dp {megatron.data_parallel_size}),\n"
        f"# rendezvous at {service.rdzv_endpoint}; rank 0 serves the control API on "
        f"{service.host}:{service.port or '<a free port>'} of its node\n"
    )


def slurm_script(config: TrinityConfig, config_file: Path, options: RecipeOptions) -> str:
    """An sbatch script: one srun task per node, each running torchrun."""
    _multi_node(config)
    service = config.service
    host, _ = service.rdzv_address
    engine_log = RunPaths.of_config(config).engine_log
    log = engine_log.with_name(f"{engine_log.stem}-%j.log")
    job_name = re.sub(r"[^\w.-]", "-", f"trinity-dagster-{config.name}")
    lines = [
        "#!/bin/bash",
        _summary(config).rstrip("\n"),
        f"# The node {host} (service.rdzv_endpoint) must be one of this job's nodes, and",
        f"# {config.run_root} and {config_file} must be at these paths on every node.",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={service.nnodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={options.gpus_per_node}"] if options.gpus_per_node else []),
        f"#SBATCH --output={log}",
        "set -euo pipefail",
        "export PYTHONUNBUFFERED=1",
        "srun --kill-on-bad-exit=1 " + shlex.join(_torchrun(config, str(config_file.resolve()))),
    ]
    return "\n".join(lines) + "\n"


def _k8s_names(config: TrinityConfig) -> tuple[str, str]:
    """(job, service) named by the endpoint `JOB-0.SERVICE[.domain]:PORT`."""
    host, _ = config.service.rdzv_address
    found = _K8S_ENDPOINT.fullmatch(host)
    if found is None:
        raise ConfigError(
            f"service.rdzv_endpoint: {config.service.rdzv_endpoint!r} does not name the first "
            "pod of an indexed Job through its headless Service; the Kubernetes recipe needs "
            "JOB-0.SERVICE:PORT, e.g. trinity-engine-0.trinity-engine:29400"
        )
    return found["job"], found["service"]


def k8s_manifest(config: TrinityConfig, options: RecipeOptions) -> str:
    """A ConfigMap, a headless Service and an indexed Job, as one multi-document YAML."""
    _multi_node(config)
    job, service_name = _k8s_names(config)
    _, port = config.service.rdzv_address
    labels = {"app.kubernetes.io/name": "trinity-dagster", "trinity-dagster/engine": job}
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{job}-config", "labels": labels},
        "data": {"config.yaml": config.to_yaml()},
    }
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service_name, "labels": labels},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels,
            "ports": [{"name": "rendezvous", "port": port}],
        },
    }
    manifests = [config_map, headless, _k8s_job(config, options, job, service_name, labels)]
    return _summary(config) + yaml.dump_all(manifests, Dumper=_BlockDumper, sort_keys=False)


def _k8s_job(
    config: TrinityConfig,
    options: RecipeOptions,
    job: str,
    service_name: str,
    labels: dict[str, str],
) -> dict[str, Any]:
    """The indexed Job: one pod per node, each running torchrun."""
    nnodes = config.service.nnodes
    _, port = config.service.rdzv_address
    container: dict[str, Any] = {
        "name": "engine",
        "image": options.image,
        "command": _torchrun(config, f"{CONFIG_MOUNT}/config.yaml"),
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        "ports": [{"containerPort": port, "name": "rendezvous"}],
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "runs", "mountPath": config.run_root},
        ],
    }
    if options.gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": options.gpus_per_node}}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job, "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": nnodes,
            "parallelism": nnodes,
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "subdomain": service_name,
                    "restartPolicy": "Never",
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": f"{job}-config"}},
                        {
                            "name": "runs",
                            "persistentVolumeClaim": {"claimName": options.runs_claim},
                        },
                    ],
                },
            },
        },
    }


class _BlockDumper(yaml.SafeDumper):
    """Writes multi-line strings (the configuration) as literal blocks, and no aliases."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _literal_multiline(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_BlockDumper.add_representer(str, _literal_multiline)


def recipe(scheduler: str, config: TrinityConfig, config_file: Path, options: RecipeOptions) -> str:
    """The launch recipe of `config` for `scheduler` ('slurm' or 'k8s')."""
    if scheduler == "slurm":
        return slurm_script(config, config_file, options)
    if scheduler == "k8s":
        return k8s_manifest(config, options)
    raise ValueError(f"unknown scheduler {scheduler!r}; known: {', '.join(SCHEDULERS)}")
