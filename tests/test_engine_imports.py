"""What an engine rank's process imports: megatron-core without torch's compiler stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trinity_dagster.testing import tiny_config

RANK_IMPORTS = """
import json, sys
import torch
from trinity_dagster.service.main import refuse_unused_imports

refuse_unused_imports()
compile_ = torch.compile
from trinity_dagster.engine.megatron_import import import_megatron_core_without_jit_fuser

first = import_megatron_core_without_jit_fuser()
again = import_megatron_core_without_jit_fuser()
from trinity_dagster.service.host import EngineHost  # what a rank imports next
from megatron.core.fusions.fused_bias_swiglu import swiglu
from trinity_dagster.checkpoint.initial_weights import create_initial_model_apart
from trinity_dagster.config import load_config
from trinity_dagster.paths import RunPaths

config = load_config(sys.argv[1])
create_initial_model_apart(config, RunPaths.of_config(config))  # as EngineHost makes it
print(json.dumps({
    "first": first,
    "again": again,
    "compile_restored": torch.compile is compile_,
    "swiglu_compiled": hasattr(swiglu, "_torchdynamo_orig_callable"),
    "compiler_modules": sorted(
        m for m in ("torch._dynamo", "torch._inductor", "transformers.models.llama.modeling_llama")
        if m in sys.modules
    ),
}))
"""


@pytest.mark.parametrize("version_0", ["copied", "built"])
def test_a_rank_imports_megatron_core_without_the_compiler_stack(
    tmp_path: Path, version_0: str
) -> None:
    """The rank's imports, up to version 0 (copied from model.path, or the tiny model built
    from scratch in a child process), leave torch's compiler stack and transformers' model
    classes out; megatron's fused functions stay plain. A built version 0 is the one
    `create_initial_model` builds in process."""
    config, _ = tiny_config(tmp_path / "source")
    from trinity_dagster.checkpoint.initial_weights import create_initial_model
    from trinity_dagster.paths import RunPaths

    source = create_initial_model(config, RunPaths.of_config(config))
    rank_config = tmp_path / "rank.yaml"
    if version_0 == "copied":
        rank = {"run_root": str(tmp_path / "rank"), "model": {"path": str(source)}}
    else:  # the same run settings, seed included, in another run root
        rank = {**config.model_dump(mode="json"), "run_root": str(tmp_path / "rank")}
    rank_config.write_text(json.dumps(rank))
    done = subprocess.run(
        [sys.executable, "-c", RANK_IMPORTS, str(rank_config)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {
        "first": True,
        "again": False,
        "compile_restored": True,
        "swiglu_compiled": False,
        "compiler_modules": [],
    }
    made = tmp_path / "rank" / source.relative_to(tmp_path / "source" / "run")
    weights, reference = (load_file(d / "model.safetensors") for d in (made, source))
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[name], tensor) for name, tensor in reference.items())


def test_a_version_0_made_apart_raises_its_error_here(tmp_path: Path) -> None:
    """An error of the child that makes version 0 is raised in the caller, as it is."""
    from trinity_dagster.checkpoint.initial_weights import create_initial_model_apart
    from trinity_dagster.paths import RunPaths

    config, _ = tiny_config(tmp_path, {"model": {"path": str(tmp_path / "nowhere")}})
    with pytest.raises(FileNotFoundError, match="nowhere: not a Hugging Face model directory"):
        create_initial_model_apart(config, RunPaths.of_config(config))
