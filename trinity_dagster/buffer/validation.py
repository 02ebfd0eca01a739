"""Row validation for the experience writer: every rejected row gets a reason naming its field."""

from __future__ import annotations

import datetime as dt
import json
import math
import reprlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trinity_dagster.buffer.schema import EXPERIENCE_SCHEMA

INPUT_SCHEMA = pa.schema([f for f in EXPERIENCE_SCHEMA if f.name != "ingest_seq"])
REQUIRED = (
    "eid",
    "task_id",
    "group_id",
    "tokens",
    "prompt_length",
    "action_mask",
    "logprobs",
    "reward",
    "model_version",
)
OPTIONAL_DEFAULTS: dict[str, Any] = {
    "explorer_id": "",
    "advantages": None,
    "returns": None,
    "created_at": None,  # filled with the write time
    "info": "{}",
}
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FLOAT_LISTS = ("logprobs", "advantages", "returns")


@dataclass(frozen=True)
class Rejection:
    """One rejected input row: its index in the write, eid if known, field, reason, the row."""

    index: int
    eid: str | None
    field: str
    reason: str
    row_json: str

    def __str__(self) -> str:
        return f"row {self.index} (eid {self.eid!r}): {self.reason}"


_SHORT_REPR = reprlib.Repr()  # keyword arguments need Python 3.12
_SHORT_REPR.maxlong = 40
_SHORT_REPR.maxstring = 60
_SHORT_REPR.maxother = 60


def _safe_repr(value: Any) -> str:
    """A short `repr` of `value` for reasons; a placeholder naming its type if it has none."""
    try:
        return _SHORT_REPR.repr(value)
    except (ValueError, RecursionError):
        return f"<{type(value).__name__} too large to show>"


def row_to_json(row: Any) -> str:
    """A row as JSON text for the quarantine table (never fails)."""
    try:
        return json.dumps(row, default=str, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        return json.dumps({"repr": _safe_repr(row)})


def _is_utf8(text: str) -> bool:
    """True if `text` can be stored as UTF-8 (no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _is_number(value: Any) -> bool:
    return _is_int(value) or isinstance(value, float | np.floating)


def _is_finite_number(value: Any) -> bool:
    """A number that converts to a finite float64 (huge ints overflow and are not)."""
    if not _is_number(value):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _check_list(name: str, value: Any, item_ok: Any, item_what: str) -> str | None:
    if not isinstance(value, list | tuple | np.ndarray):
        return f"{name}: expected a list of {item_what}, got {type(value).__name__}"
    for i, item in enumerate(value):
        if not item_ok(item):
            return f"{name}[{i}]: expected {item_what}, got {_safe_repr(item)}"
    return None


def _check_field(name: str, value: Any) -> str | None:
    """A type/range problem of one input field, or None."""
    if name in ("eid", "task_id", "group_id", "explorer_id"):
        if not isinstance(value, str):
            return f"{name}: expected a string, got {type(value).__name__}"
        if not _is_utf8(value):
            return f"{name}: not valid UTF-8 text ({_safe_repr(value)})"
        if name == "eid" and not value:
            return "eid: empty string"
        return None
    if name == "tokens":
        return _check_list(
            name, value, lambda t: _is_int(t) and 0 <= t <= INT32_MAX, "int32 token ids >= 0"
        )
    if name in ("prompt_length", "model_version"):
        if not _is_int(value):
            return f"{name}: expected an integer, got {_safe_repr(value)}"
        limit = INT32_MAX if name == "prompt_length" else INT64_MAX
        if not 0 <= value <= limit:
            return f"{name}: out of range 0..{limit} ({_safe_repr(value)})"
        return None
    if name == "action_mask":
        return _check_list(name, value, lambda b: isinstance(b, bool | np.bool_), "booleans")
    if name in ("logprobs", "advantages", "returns"):
        if value is None and name != "logprobs":
            return None
        return _check_list(name, value, _is_finite_number, "finite numbers")
    if name == "reward":
        if not _is_finite_number(value):
            return f"reward: expected a finite number, got {_safe_repr(value)}"
        return None
    if name == "created_at":
        if value is not None and not (isinstance(value, dt.datetime) and value.tzinfo):
            return f"created_at: expected a timezone-aware datetime, got {_safe_repr(value)}"
        return None
    if name == "info":
        return _check_info(value)
    return f"{name}: unknown field"


def _check_info(value: Any) -> str | None:
    """A problem of an `info` value (JSON text or a dict), or None."""
    if isinstance(value, dict):
        try:
            text = json.dumps(value)
        except (TypeError, ValueError, RecursionError) as err:
            return f"info: not JSON-serializable ({err})"
    elif isinstance(value, str):
        text = value
    else:
        return f"info: expected JSON text or a dict, got {type(value).__name__}"
    if not _is_utf8(text):
        return f"info: not valid UTF-8 text ({text[:40]!r})"
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):
        return f"info: not valid JSON text ({text[:40]!r})"
    return _check_priority(parsed)


def _check_priority(info: Any) -> str | None:
    """A numeric `info["priority"]` (what the priority strategy ranks by) must be finite."""
    if not isinstance(info, dict) or "priority" not in info:
        return None
    value = info["priority"]
    if _is_number(value) and not _is_finite_number(value):
        return f"info.priority: expected a finite number, got {_safe_repr(value)}"
    return None


def rows_to_table(
    rows: Sequence[Mapping[str, Any]], now: dt.datetime
) -> tuple[pa.Table, list[int], list[Rejection]]:
    """Type-check mappings one by one; the good ones as a table, their input indices, rejects."""
    good: list[dict[str, Any]] = []
    kept: list[int] = []
    rejects: list[Rejection] = []
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            rejects.append(Rejection(index, None, "<row>", "row: not a mapping", row_to_json(row)))
            continue
        eid = row.get("eid")
        known_eid = eid if isinstance(eid, str) and _is_utf8(eid) else None
        problem = _row_problem(row)
        if problem is not None:
            field, reason = problem
            rejects.append(Rejection(index, known_eid, field, reason, row_to_json(dict(row))))
            continue
        good.append(_normalized(row, now))
        kept.append(index)
    table = pa.Table.from_pylist(good, schema=INPUT_SCHEMA)
    return table, kept, rejects


def _normalized(row: Mapping[str, Any], now: dt.datetime) -> dict[str, Any]:
    """A checked row with defaults filled, `info` as text and float columns as Python floats.

    Arrow converts integers to float columns only when exactly representable (and numpy
    uint64 wrongly), so valid numbers are handed to it as floats.
    """
    clean = {**OPTIONAL_DEFAULTS, **row}
    if clean["created_at"] is None:
        clean["created_at"] = now
    if isinstance(clean["info"], dict):
        clean["info"] = json.dumps(clean["info"])
    clean["reward"] = float(clean["reward"])
    for name in FLOAT_LISTS:
        if clean[name] is not None:
            clean[name] = [float(x) for x in clean[name]]
    return clean


def _row_problem(row: Mapping[str, Any]) -> tuple[str, str] | None:
    for name in row:
        if name == "ingest_seq":
            return name, "ingest_seq: assigned by the writer, must not be given"
        if name not in INPUT_SCHEMA.names:
            label = name if isinstance(name, str) else _safe_repr(name)
            return label, f"{label}: unknown field"
    for name in REQUIRED:
        if name not in row:
            return name, f"{name}: missing required field"
    for name in INPUT_SCHEMA.names:
        if name in row:
            reason = _check_field(name, row[name])
            if reason is not None:
                return name, reason
    return None


def _columns_problem(names: Sequence[str]) -> tuple[str, str] | None:
    """(column, reason) if the columns of an input table are not a valid set, else None."""
    for name in names:
        if name == "ingest_seq":
            return name, "ingest_seq: assigned by the writer, must not be given"
        if name not in INPUT_SCHEMA.names:
            return name, f"{name}: unknown column"
    for name in REQUIRED:
        if name not in names:
            return name, f"{name}: missing required column"
    return None


_LIST_TYPES = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)


def _same_kind(source: pa.DataType, target: pa.DataType) -> bool:
    """Whether arrow type `source` holds the kind of values the row path accepts for `target`.

    Integers for integer columns, numbers for float columns, text, booleans, timezone-aware
    timestamps, and lists of those; an all-null type fits any column.
    """
    if pa.types.is_null(source):
        return True
    if pa.types.is_dictionary(source):
        return _same_kind(source.value_type, target)
    if pa.types.is_list(target):
        is_list = any(check(source) for check in _LIST_TYPES)
        return is_list and _same_kind(source.value_type, target.value_type)
    if pa.types.is_integer(target):
        return pa.types.is_integer(source)
    if pa.types.is_floating(target):
        return pa.types.is_integer(source) or pa.types.is_floating(source)
    if pa.types.is_string(target):
        return pa.types.is_string(source) or pa.types.is_large_string(source)
    if pa.types.is_boolean(target):
        return pa.types.is_boolean(source)
    if pa.types.is_timestamp(target):
        return pa.types.is_timestamp(source) and source.tz is not None
    return False


def _cast_is_safe(target: pa.DataType) -> bool:
    """Casts to `target` must not lose data, except to floats: numbers round as float() does."""
    element = target.value_type if pa.types.is_list(target) else target
    return not pa.types.is_floating(element)


def _cast_failures(
    column: pa.ChunkedArray, target: pa.DataType, rows: np.ndarray | None = None
) -> list[tuple[int, str]]:
    """(index, error) of each of `rows` (default all) of `column` that does not cast to `target`.

    Parts are copied with `take`: a cast of a sliced list array checks its whole child array.
    """
    try:
        (column if rows is None else column.take(rows)).cast(target, safe=_cast_is_safe(target))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
        if rows is None:
            return _cast_failures(column, target, np.arange(len(column)))
        if len(rows) == 1:
            return [(int(rows[0]), str(err))]
        half = len(rows) // 2
        return _cast_failures(column, target, rows[:half]) + _cast_failures(
            column, target, rows[half:]
        )
    return []


def _unstorable(column: pa.ChunkedArray, field: pa.Field) -> list[tuple[int, str]]:
    """(index, reason) of each value of `column` that `field` cannot hold.

    The reason is the one the row path gives for the value, else what Arrow objects to.
    """
    if _same_kind(column.type, field.type):
        failures = _cast_failures(column, field.type)
    else:
        refused = f"column type {column.type} does not hold {field.type} values"
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        failures = [(int(i), refused) for i in np.flatnonzero(valid)]
    return [
        (i, _check_field(field.name, column[i].as_py()) or f"{field.name}: {error}")
        for i, error in failures
    ]


def _refused_rows(table: pa.Table) -> dict[int, tuple[str, str]]:
    """Rows with a value their column cannot hold: index -> (field, reason) of the first."""
    refused: dict[int, tuple[str, str]] = {}
    for field in INPUT_SCHEMA:
        if field.name in table.column_names:
            for index, reason in _unstorable(table.column(field.name), field):
                refused.setdefault(index, (field.name, reason))
    return refused


def _conformed_column(table: pa.Table, field: pa.Field, now: dt.datetime) -> pa.ChunkedArray:
    """Column `field` of rows whose values it can hold, as its type; absent: its default."""
    n = table.num_rows
    if field.name not in table.column_names:
        default = now if field.name == "created_at" else OPTIONAL_DEFAULTS[field.name]
        return pa.chunked_array([pa.array([default] * n, type=field.type)])
    column = table.column(field.name)
    if not _same_kind(column.type, field.type):
        return pa.chunked_array([pa.nulls(n, field.type)])  # non-null values were refused
    return column.cast(field.type, safe=_cast_is_safe(field.type))


def conform_table(table: pa.Table, now: dt.datetime) -> tuple[pa.Table, list[int], list[Rejection]]:
    """Cast an input arrow table to the input schema; its storable rows, their indices, rejects.

    A bad set of columns rejects every row; a value its column cannot hold rejects its row,
    with the reason the row path gives for that value.
    """
    problem = _columns_problem(table.column_names)
    if problem is not None:
        field, reason = problem
        rejects = [
            Rejection(i, None, field, reason, row_to_json(row))
            for i, row in enumerate(table.to_pylist())
        ]
        return INPUT_SCHEMA.empty_table(), [], rejects
    refused = _refused_rows(table)
    keep = np.ones(table.num_rows, dtype=bool)
    keep[list(refused)] = False
    rejects = _refusals(table, refused)
    good = table.filter(pa.array(keep))  # a copy: casts of its lists check only these rows
    columns = [_conformed_column(good, field, now) for field in INPUT_SCHEMA]
    conformed = pa.Table.from_arrays(columns, schema=INPUT_SCHEMA.with_metadata(None))
    return conformed, np.flatnonzero(keep).tolist(), rejects


def _refusals(table: pa.Table, refused: dict[int, tuple[str, str]]) -> list[Rejection]:
    """The rejections of the `refused` rows of `table`, in row order."""
    indices = sorted(refused)
    rows = table.take(pa.array(indices, pa.int64())).to_pylist() if indices else []
    return [
        Rejection(i, _eid_of(row), *refused[i], row_to_json(row))
        for i, row in zip(indices, rows, strict=True)
    ]


def _eid_of(row: Mapping[str, Any]) -> str | None:
    """The eid of an input row, if it is text."""
    eid = row.get("eid")
    return eid if isinstance(eid, str) else None


def _np(array: pa.ChunkedArray | pa.Array, fill: Any) -> np.ndarray:
    return array.fill_null(fill).to_numpy(zero_copy_only=False)


def _list_lengths(table: pa.Table, name: str) -> np.ndarray:
    return _np(pc.list_value_length(table.column(name)), -1).astype(np.int64)


def _bad_children(table: pa.Table, name: str, bad: Any) -> np.ndarray:
    """Row mask: some element of list column `name` is null or matches `bad(values)`."""
    column = table.column(name).combine_chunks()
    mask = np.zeros(table.num_rows, dtype=bool)
    if len(column) == 0:
        return mask
    values = pc.list_flatten(column)
    parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
    flags = values.is_null().to_numpy(zero_copy_only=False)
    if bad is not None:
        flags = flags | _np(bad(values), True)
    mask[parents[flags]] = True
    return mask


def semantic_checks(
    table: pa.Table,
    max_model_len: int,
    known_versions: set[int] | None,
    existing_eids: Collection[str],
) -> list[tuple[str, str] | None]:
    """Per row: None if valid, else (field, reason) for its first problem. `existing_eids`
    holds (at least) the eids of the table's rows that are stored already."""
    n = table.num_rows
    problems: list[tuple[str, str] | None] = [None] * n

    def flag(mask: np.ndarray, field: str, describe: Any) -> None:
        for i in np.flatnonzero(mask):
            if problems[i] is None:
                problems[i] = (field, describe(int(i)))

    for field in INPUT_SCHEMA:
        if not field.nullable:
            nulls = table.column(field.name).is_null().to_numpy(zero_copy_only=False)
            flag(nulls, field.name, lambda i, f=field.name: f"{f}: null in a non-nullable column")
    eids = table.column("eid").to_pylist()
    flag(np.array([e == "" for e in eids], dtype=bool), "eid", lambda i: "eid: empty string")
    n_tokens = _list_lengths(table, "tokens")
    prompt = _np(table.column("prompt_length"), 0).astype(np.int64)
    response = n_tokens - prompt
    flag(prompt < 0, "prompt_length", lambda i: f"prompt_length: negative ({prompt[i]})")
    flag(
        _bad_children(table, "tokens", lambda v: pc.less(v, 0)),
        "tokens",
        lambda i: "tokens: null or negative token id",
    )
    flag(
        (n_tokens >= 0) & (response < 1),
        "tokens",
        lambda i: f"tokens: empty response (len(tokens)={n_tokens[i]}, prompt_length={prompt[i]})",
    )
    flag(
        n_tokens > max_model_len,
        "tokens",
        lambda i: f"tokens: length {n_tokens[i]} exceeds model.max_model_len {max_model_len}",
    )
    finite = pc.is_finite
    for name, nullable in (
        ("logprobs", False),
        ("action_mask", False),
        ("advantages", True),
        ("returns", True),
    ):
        lengths = _list_lengths(table, name)
        present = lengths >= 0 if nullable else np.ones(n, dtype=bool)
        flag(
            present & (lengths != response),
            name,
            lambda i, nm=name, ln=lengths: (
                f"{nm}: length {ln[i]} != response length "
                f"{response[i]} (len(tokens) - prompt_length)"
            ),
        )
        check = None if name == "action_mask" else (lambda v: pc.invert(finite(v)))
        flag(
            _bad_children(table, name, check),
            name,
            lambda i, nm=name: f"{nm}: null or non-finite value",
        )
    rewards = _np(table.column("reward"), 0.0).astype(np.float64)
    flag(~np.isfinite(rewards), "reward", lambda i: f"reward: not finite ({rewards[i]})")
    versions = _np(table.column("model_version"), 0).astype(np.int64)
    flag(versions < 0, "model_version", lambda i: f"model_version: negative ({versions[i]})")
    if known_versions is not None:
        unknown = np.array([v not in known_versions for v in versions.tolist()], dtype=bool)
        flag(
            unknown,
            "model_version",
            lambda i: (
                f"model_version: {versions[i]} is not a known weights version "
                f"(known: {sorted(known_versions)[-5:]}...)"
            ),
        )
    infos = table.column("info").to_pylist()
    flag(
        np.array([s is not None and _check_info(s) is not None for s in infos], dtype=bool),
        "info",
        lambda i: _check_info(infos[i]) or "",
    )
    seen: set[str] = set()
    for i, eid in enumerate(eids):
        if problems[i] is not None or eid is None:
            continue
        if eid in existing_eids:
            problems[i] = ("eid", f"eid: {eid!r} already in the experiences table")
        elif eid in seen:
            problems[i] = ("eid", f"eid: {eid!r} duplicated within the write")
        else:
            seen.add(eid)
    return problems
