"""What an engine rank's process imports: megatron-core without torch's compiler stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
from trinity_dagster.checkpoint.initial_weights import create_initial_model
from trinity_dagster.config import load_config
from trinity_dagster.paths import RunPaths

config = load_config(sys.argv[1])
create_initial_model(config, RunPaths.of_config(config))  # a copy of model.path
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


def test_a_rank_imports_megatron_core_without_the_compiler_stack(tmp_path: Path) -> None:
    """The rank's imports, up to a version 0 copied from model.path, leave torch's compiler
    stack and transformers' model classes out; megatron's fused functions stay plain."""
    config, _ = tiny_config(tmp_path / "source")
    from trinity_dagster.checkpoint.initial_weights import create_initial_model
    from trinity_dagster.paths import RunPaths

    source = create_initial_model(config, RunPaths.of_config(config))
    copy_config = tmp_path / "copy.yaml"
    copy_config.write_text(
        json.dumps({"run_root": str(tmp_path / "copy"), "model": {"path": str(source)}})
    )
    done = subprocess.run(
        [sys.executable, "-c", RANK_IMPORTS, str(copy_config)], capture_output=True, text=True
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
