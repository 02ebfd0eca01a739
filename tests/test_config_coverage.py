"""Every configuration key acts: code outside config.py reads it, or it is listed below.

"Reads" is attribute access on the key's own section: `<section>.<key>` where the section is
reached by its name (`config.algorithm.gamma`, `optim.lr`), through a local alias
(`algo = self.config.algorithm; algo.gamma`) or a parameter annotated with the section's
class (`optim: OptimConfig`), or `getattr(<section>, "<key>")`. A key read only by a
property of its section in config.py counts when code elsewhere reads that property
(`model.max_model_len`). A key that is only declared (or only copied into another object
under the same name) is not read: that is how `algorithm.gamma` once went unused.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

from trinity_dagster.config import TrinityConfig

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("trinity_dagster", "assets", "resources")
CONFIG_FILE = ROOT / "trinity_dagster" / "config.py"

# Keys that act without being read outside config.py, each with the reason.
ACTS_WITHOUT_A_READER: dict[str, str] = {
    "algorithm.algorithm_type": (
        "selects the ALGORITHM_PRESETS entry in config.py while the file loads "
        "(tests/test_config.py shows each preset's keys)"
    ),
    "service.nproc_per_node": (
        "read by ServiceConfig.procs_per_node, which the launcher, `engine join` and the "
        "Slurm/Kubernetes recipes call (tests/test_multinode.py)"
    ),
}

ROOT_NAMES = ("config", "cfg")  # how code names the whole TrinityConfig


def _sections(model: type[BaseModel]) -> Iterator[tuple[str, type[BaseModel]]]:
    """(field name, section class) of each sub-section of `model`."""
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            yield name, kind


def config_keys(model: type[BaseModel] = TrinityConfig, prefix: str = "") -> dict[str, tuple]:
    """Every leaf key's dotted path -> (its section class, its field name)."""
    keys: dict[str, tuple] = {}
    nested = dict(_sections(model))
    for name in model.model_fields:
        if name in nested:
            keys.update(config_keys(nested[name], f"{prefix}{name}."))
        else:
            keys[f"{prefix}{name}"] = (model, name)
    return keys


def section_names() -> dict[str, type[BaseModel]]:
    """Name a section goes by in code -> its class (its field name in the parent)."""
    names: dict[str, type[BaseModel]] = dict.fromkeys(ROOT_NAMES, TrinityConfig)
    pending = [TrinityConfig]
    while pending:
        for name, section in _sections(pending.pop()):
            names[name] = section
            pending.append(section)
    return names


class _Reads(ast.NodeVisitor):
    """The (section class, attribute) pairs one module reads."""

    def __init__(self, names: dict[str, type[BaseModel]]) -> None:
        self.names = names
        self.classes = {cls.__name__: cls for cls in set(names.values())}
        self.aliases: dict[str, type[BaseModel]] = {}
        self.reads: set[tuple[type[BaseModel], str]] = set()

    def section_of(self, node: ast.expr) -> type[BaseModel] | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id) or self.names.get(node.id)
        if isinstance(node, ast.Attribute):
            parent = self.section_of(node.value)
            children = dict(_sections(parent)) if parent else {}
            return children.get(node.attr) or self.names.get(node.attr)
        return None

    def collect_aliases(self, tree: ast.AST) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
                if isinstance(target, ast.Name) and (section := self.section_of(value)):
                    self.aliases[target.id] = section
            elif isinstance(node, ast.arg) and node.annotation is not None:
                annotation = ast.unparse(node.annotation).strip("'\"").split(".")[-1]
                if annotation in self.classes:
                    self.aliases[node.arg] = self.classes[annotation]

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if section := self.section_of(node.value):
            self.reads.add((section, node.attr))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (
            isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and (section := self.section_of(node.args[0]))
        ):
            self.reads.add((section, node.args[1].value))
        self.generic_visit(node)


def source_reads() -> set[tuple[type[BaseModel], str]]:
    """Every (section class, attribute) that code outside config.py reads."""
    names = section_names()
    reads: set[tuple[type[BaseModel], str]] = set()
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == CONFIG_FILE:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            visitor = _Reads(names)
            visitor.collect_aliases(tree)
            visitor.visit(tree)
            reads |= visitor.reads
    return reads


def property_fields() -> dict[tuple[type[BaseModel], str], set[str]]:
    """(section class, property name) -> the keys of that section its body reads."""
    classes = {cls.__name__: cls for cls in set(section_names().values())}
    found: dict[tuple[type[BaseModel], str], set[str]] = {}
    for cls_node in ast.parse(CONFIG_FILE.read_text()).body:
        if not (isinstance(cls_node, ast.ClassDef) and cls_node.name in classes):
            continue
        for fn in cls_node.body:
            if isinstance(fn, ast.FunctionDef) and any(
                isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list
            ):
                found[(classes[cls_node.name], fn.name)] = {
                    node.attr
                    for node in ast.walk(fn)
                    if isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                }
    return found


def read_keys() -> set[str]:
    """The dotted keys that some code reads (directly, or through a section property)."""
    reads = source_reads()
    for (section, prop), fields in property_fields().items():
        if (section, prop) in reads:
            reads |= {(section, field) for field in fields}
    return {path for path, owner in config_keys().items() if owner in reads}


def test_every_config_key_is_read_by_code() -> None:
    unread = sorted(set(config_keys()) - read_keys() - set(ACTS_WITHOUT_A_READER))
    assert not unread, (
        "configuration keys that no code outside config.py reads (make them act, or list "
        f"them in ACTS_WITHOUT_A_READER with the reason): {unread}"
    )


def test_the_exception_list_is_current() -> None:
    keys, read = set(config_keys()), read_keys()
    stale = {key for key in ACTS_WITHOUT_A_READER if key not in keys or key in read}
    assert not stale, f"ACTS_WITHOUT_A_READER lists keys that are gone or now read: {stale}"


def test_the_rule_finds_reads_through_aliases_and_parameters() -> None:
    source = (
        "def f(self, optim: OptimConfig):\n"
        "    algo = self.config.algorithm\n"
        "    return algo.gamma, optim.lr, self.config.trainer.total_steps, opts.opmd_tau\n"
    )
    visitor = _Reads(section_names())
    tree = ast.parse(source)
    visitor.collect_aliases(tree)
    visitor.visit(tree)
    attributes = {attr for _, attr in visitor.reads}
    assert {"gamma", "lr", "total_steps"} <= attributes
    assert "opmd_tau" not in attributes  # an options object is not the config section
